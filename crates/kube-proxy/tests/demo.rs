//! `kube-proxy demo` end to end: it runs, names the pods that answered, and leaves no
//! namespace, process, rule or sysctl change behind, whether it finishes, is interrupted
//! half-way (SIGINT) or is stopped while holding the cluster (`--keep`, SIGTERM). Needs root,
//! like every kernel test here; it fails (never skips) without it.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Mutex, PoisonError, mpsc};
use std::time::{Duration, Instant};

const KUBE_PROXY: &str = env!("CARGO_BIN_EXE_kube-proxy");

/// This suite's namespace prefix (unique to it, so leftovers are attributable).
const PREFIX: &str = "kpodemo-";

/// Bound on a whole demo run; it takes about a second.
const RUN_DEADLINE: Duration = Duration::from_secs(120);

/// The leftover checks look at every process and namespace, so the tests take turns.
static SERIAL: Mutex<()> = Mutex::new(());

/// Global settings a careless proxy would change on the host (conntrack table size and
/// timeouts are host-wide or inherited; route_localnet is what iptables mode sets).
const HOST_SYSCTLS: &[&str] = &[
    "/proc/sys/net/netfilter/nf_conntrack_max",
    "/proc/sys/net/netfilter/nf_conntrack_tcp_timeout_established",
    "/proc/sys/net/netfilter/nf_conntrack_tcp_timeout_close_wait",
    "/proc/sys/net/ipv4/conf/all/route_localnet",
    "/proc/sys/net/ipv4/ip_forward",
];

/// What the host looks like from outside the demo's namespaces.
#[derive(Debug, PartialEq, Eq)]
struct HostState {
    ruleset: String,
    iptables: String,
    sysctls: Vec<(String, String)>,
}

fn command_output(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program} {args:?}: {e} (install it: ./setup.sh)"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn host_state() -> HostState {
    HostState {
        // Stateless listing: counters of any existing rule may move meanwhile.
        ruleset: command_output("nft", &["-s", "list", "ruleset"]),
        iptables: command_output("iptables", &["-t", "nat", "-S"]),
        sysctls: HOST_SYSCTLS
            .iter()
            .filter_map(|path| {
                std::fs::read_to_string(path)
                    .ok()
                    .map(|v| ((*path).to_owned(), v))
            })
            .collect(),
    }
}

/// Fails if any namespace under [`PREFIX`] or any process of this binary's demo (the proxy,
/// echo servers, probes) is left.
fn assert_nothing_left(before: &HostState, output: &str) {
    let namespaces = command_output("ip", &["netns", "list"]);
    let ours: Vec<&str> = namespaces
        .lines()
        .filter(|l| l.starts_with(PREFIX))
        .collect();
    assert!(ours.is_empty(), "namespaces left: {ours:?}\n{output}");
    let mut left = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(raw) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&raw).replace('\0', " ");
        if cmdline.starts_with(KUBE_PROXY)
            && (cmdline.contains("testbed-echo") || cmdline.contains("demo-node"))
        {
            left.push(cmdline);
        }
    }
    assert!(left.is_empty(), "processes left: {left:?}\n{output}");
    assert_eq!(&host_state(), before, "the host changed\n{output}");
}

fn demo(args: &[&str]) -> Command {
    let mut command = Command::new(KUBE_PROXY);
    command
        .arg("demo")
        .arg(format!("--netns-prefix={PREFIX}"))
        .args(args);
    command
}

/// Waits (bounded) for `child` to exit, killing it on timeout.
fn finish(mut child: Child) -> Output {
    let deadline = Instant::now() + RUN_DEADLINE;
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the demo did not finish within {RUN_DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().expect("collect output")
}

#[test]
fn demo_names_the_pods_that_answered_and_leaves_nothing_behind() {
    let _turn = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    for mode in ["iptables", "nftables"] {
        let before = host_state();
        let child = demo(&["--proxy-mode", mode, "--connections", "6"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the demo");
        let out = finish(child);
        let text = format!(
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{mode}: demo failed:\n{text}");
        assert!(text.contains(&format!("({mode} mode)")), "{text}");
        // Every connection of the three scenarios was answered by one of the pods, by name
        // and pod address (no connection line says UNEXPECTED).
        let answered: Vec<&str> = text
            .lines()
            .filter(|l| l.trim_start().starts_with("request"))
            .collect();
        assert_eq!(answered.len(), 18, "{text}");
        for line in &answered {
            let named = [
                ("web-a", "10.244.1.3:8080"),
                ("web-b", "10.244.1.4:8080"),
                ("web-c", "10.244.2.2:8080"),
            ]
            .iter()
            .any(|(pod, addr)| line.contains(&format!("-> {pod} ")) && line.contains(addr));
            assert!(named, "not answered by a named pod: {line}\n{text}");
        }
        assert!(text.contains("affinity held: every answered connection went to web-"));
        // NodePort traffic from outside with externalTrafficPolicy Cluster is masqueraded.
        assert!(
            text.contains("6 of 6 answered connections were masqueraded"),
            "{text}"
        );
        assert!(text.contains("nothing of the demo is left"), "{text}");
        assert_nothing_left(&before, &text);
    }
}

/// Starts the demo with stdout piped and returns it with a channel of its lines.
fn spawn_watched(args: &[&str]) -> (Child, mpsc::Receiver<String>) {
    let mut child = demo(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the demo");
    let stdout = child.stdout.take().expect("piped");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

/// Reads lines until one contains `marker`; returns everything read.
fn read_until(lines: &mpsc::Receiver<String>, marker: &str) -> String {
    let deadline = Instant::now() + RUN_DEADLINE;
    let mut seen = String::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => {
                seen.push_str(&line);
                seen.push('\n');
                if line.contains(marker) {
                    return seen;
                }
            }
            Err(_) => panic!("the demo never printed {marker:?}; it printed:\n{seen}"),
        }
    }
}

fn signal(child: &Child, name: &str) {
    let status = Command::new("kill")
        .args([&format!("-{name}"), &child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success());
}

fn stopped(mut child: Child, lines: &mpsc::Receiver<String>, seen: String) -> String {
    let mut stderr = String::new();
    let pipe = child.stderr.take();
    let out = finish(child);
    if let Some(mut pipe) = pipe {
        let _ = pipe.read_to_string(&mut stderr);
    }
    let rest: Vec<String> = lines.try_iter().collect();
    let text = format!("{seen}{}\n{stderr}", rest.join("\n"));
    assert_eq!(out.status.code(), Some(130), "{text}");
    assert!(
        text.contains("interrupted; everything it created was removed"),
        "{text}"
    );
    text
}

#[test]
fn sigint_while_the_proxy_starts_removes_everything() {
    let _turn = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let before = host_state();
    let (child, lines) = spawn_watched(&[]);
    // The namespaces and echo servers exist; the proxy is being started.
    let seen = read_until(&lines, "Starting kube-proxy");
    signal(&child, "INT");
    let text = stopped(child, &lines, seen);
    assert_nothing_left(&before, &text);
}

#[test]
fn sigterm_while_keeping_the_cluster_removes_everything() {
    let _turn = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let before = host_state();
    let (child, lines) = spawn_watched(&["--keep", "--connections", "2"]);
    let seen = read_until(&lines, "stays up until Ctrl-C");
    // While it holds, the namespaces really are there (the check below is not vacuous).
    let namespaces = command_output("ip", &["netns", "list"]);
    assert!(
        namespaces.lines().any(|l| l.starts_with(PREFIX)),
        "{namespaces}"
    );
    signal(&child, "TERM");
    let text = stopped(child, &lines, seen);
    assert_nothing_left(&before, &text);
}
