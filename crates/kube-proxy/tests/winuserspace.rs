//! winuserspace on Windows, as far as this Linux machine can show it: the Windows binary
//! (`x86_64-pc-windows-gnu`, built by `tools/win/build.sh`) runs under Wine inside the node
//! namespace of a `kp-testbed` cluster, from manifests, and real connections from a pod and
//! from an external client reach the pods through its portals: ClusterIP, externalIP,
//! LoadBalancer IP and NodePort over TCP and UDP, round robin, ClientIP affinity, a refusing
//! endpoint skipped, an edit moving traffic, `/healthz`, and a clean exit on Ctrl-C.
//!
//! Wine's limits shape the set-up: `CreateUnicastIpAddressEntry` is only a stub there, so the
//! service addresses are put on the node's interfaces beforehand (the proxy finds them with
//! `GetUnicastIpAddressTable` and uses them without adding), and one service whose address is
//! not there checks that the missing function is reported, naming the address and the
//! interface. Wine binds a UDP socket on an interface's address as the wildcard address plus
//! `SO_BINDTODEVICE` of that interface (so it can get broadcasts), which Windows does not: such
//! a UDP portal only sees datagrams arriving on that interface and answers from the
//! interface's primary address, which the client drops. So UDP is checked on the NodePort
//! only (a wildcard bind, as on Windows, reached at the node's address); UDP portals on
//! service addresses are checked over real sockets on Linux, in kp-userspace's
//! `tests/winuserspace.rs`. Wine creates sockets in its `wineserver`, so the prefix is
//! initialised (and its server started) inside the node namespace too, after the addresses
//! are in place.
//!
//! Needs root, Wine, MinGW-w64 and rustup's `x86_64-pc-windows-gnu` standard library
//! (`./setup.sh --tests`); it fails, saying what is missing, without them.

use kp_suite::support;

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kp_testbed::proxy::{FIRST_SYNC_LOG, ProxyLaunch, ProxyProcess, SYNCED_LOG, signal};
use kp_testbed::{Cluster, Host, Tally};
use support::{Service, THIS_NODE, http_get_path, node_yaml};

/// Wine's 64-bit loader (Debian's `wine64`).
const WINE64: &str = "/usr/lib/wine/wine64";
/// `INTERFACE_TO_ADD_SERVICE_IP`: named in the error for the address Wine cannot add.
const SERVICE_NIC: &str = "eth0";
/// Each service address and the node interface it sits on: ClusterIPs on loopback, the
/// external ones on the LAN interface their traffic comes in on (see the module docs on UDP).
const SERVICE_ADDRESSES: [(&str, &str); 5] = [
    ("10.96.0.13", "lo"),
    ("10.96.0.10", "lo"),
    ("10.96.0.12", "lo"),
    ("192.168.50.100", "eth0"),
    ("198.51.100.30", "eth0"),
];
/// A service whose address nobody put on the node: Wine cannot add it.
const UNADDED_IP: &str = "10.96.0.99";
/// How long the proxy under Wine may take for a start or a sync.
const PATIENCE: Duration = Duration::from_secs(60);
/// Flows per spread check: three per endpoint, so round robin shows exactly.
const FLOWS: usize = 9;

/// Builds the Windows binary; returns its directory (with the Wine shim DLL).
fn windows_binary() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/win/build.sh");
    let started = Instant::now();
    let out = Command::new("bash")
        .arg(&script)
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "building the Windows binary failed (run ./setup.sh --tests for MinGW-w64 and the target's standard library):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dir = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    eprintln!("Windows build: {:.1?}", started.elapsed());
    PathBuf::from(dir)
}

/// A path as the Windows program sees it (Wine's `Z:` is `/`).
fn windows_path(path: &Path) -> String {
    format!("Z:{}", path.display()).replace('/', "\\")
}

/// The cluster: pods a and b on this node, c on the other.
fn cluster() -> Cluster {
    Cluster::builder()
        .pod("a")
        .pod("b")
        .remote_pod("c")
        .build()
        .expect(
            "test cluster builds (needs root, iproute2, and `cargo build -p kp-testbed --bins`)",
        )
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("literal address")
}

/// Runs `args` in the node namespace, failing the test on an error.
fn node_exec(cluster: &Cluster, args: &[&str]) {
    cluster
        .exec(cluster.node_ns(), args)
        .unwrap_or_else(|e| panic!("{args:?} in the node namespace: {e}"));
}

/// The Wine environment of one prefix; commands run inside the node namespace.
struct Wine {
    prefix: PathBuf,
    node_ns: String,
}

impl Wine {
    fn env(&self, command: &mut Command) {
        command
            .env("WINEPREFIX", &self.prefix)
            .env("WINEDEBUG", "-all")
            .env("WINEDLLOVERRIDES", "mscoree,mshtml=")
            .env_remove("DISPLAY");
    }

    /// Creates the prefix (and starts its wineserver) inside the node namespace.
    fn init(&self) {
        assert!(
            Path::new(WINE64).exists(),
            "{WINE64} is missing: run ./setup.sh --tests (Debian's wine and wine64)"
        );
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.node_ns, WINE64, "wineboot", "--init"]);
        self.env(&mut command);
        let out = command.output().expect("run wineboot");
        assert!(
            out.status.success(),
            "wineboot --init failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for Wine {
    /// Ends every process of the prefix (its wineserver included).
    fn drop(&mut self) {
        let mut command = Command::new("ip");
        command.args([
            "netns",
            "exec",
            &self.node_ns,
            "/usr/lib/wine/wineserver",
            "-k",
        ]);
        self.env(&mut command);
        let _ = command.output();
    }
}

/// The manifests directory and what is in it.
struct Manifests {
    dir: tempfile::TempDir,
}

impl Manifests {
    /// Writes `file` atomically (a dot-file, which the source skips, renamed over).
    fn write(&self, file: &str, text: &str) {
        let tmp = self.dir.path().join(format!(".{file}.tmp"));
        std::fs::write(&tmp, text).expect("write manifest");
        std::fs::rename(&tmp, self.dir.path().join(file)).expect("rename manifest");
    }
}

/// The web service (ClusterIP, NodePorts, an externalIP) with `pods` as its endpoints.
fn web(cluster: &Cluster, pods: &[&str]) -> Service {
    Service::new("web", "10.96.0.10")
        .tcp(80)
        .node_port(30080)
        .udp(80)
        .node_port(30081)
        .external_ip("192.168.50.100")
        .endpoints(cluster, pods)
}

/// Every flow answered, by exactly these pods (each at least once).
fn assert_answered_by(what: &str, tally: &Tally, pods: &[&str], proxy: &ProxyProcess) {
    let by_pod = tally.by_pod();
    let answered: usize = by_pod.values().sum();
    let seen: BTreeSet<&str> = by_pod.keys().map(String::as_str).collect();
    let want: BTreeSet<&str> = pods.iter().copied().collect();
    assert!(
        answered == tally.len() && seen == want,
        "{what}: want every flow answered by {want:?}, got {:?}\nproxy log:\n{}",
        tally.outcomes(),
        proxy.tail(80)
    );
}

/// Waits for a log line `matches` accepts.
fn wait_log(proxy: &mut ProxyProcess, what: &str, matches: impl Fn(&str) -> bool) {
    if let Err(error) = proxy.wait_for(what, PATIENCE, matches) {
        panic!("{what}: {error}\nproxy log:\n{}", proxy.tail(80));
    }
}

#[test]
fn winuserspace_under_wine_carries_real_traffic() {
    let exe_dir = windows_binary();
    let exe = exe_dir.join("kube-proxy.exe");
    let cl = cluster();
    let work = tempfile::tempdir().expect("temp dir");
    let wine = Wine {
        prefix: work.path().join("prefix"),
        node_ns: cl.node_ns().to_owned(),
    };

    // The service addresses on an interface of the node (Wine cannot add them), and routes
    // from the router for the external ones.
    for (vip, nic) in SERVICE_ADDRESSES {
        let address = format!("{vip}/32");
        node_exec(&cl, &["ip", "addr", "add", &address, "dev", nic]);
    }
    let node_ip = cl.node_ip().to_string();
    for vip in ["192.168.50.100/32", "198.51.100.30/32"] {
        cl.exec(
            cl.router().ns(),
            &["ip", "route", "add", vip, "via", &node_ip],
        )
        .expect("route a service address to the node");
    }

    // Wine's address table is read when its prefix starts: the addresses come first.
    let started = Instant::now();
    wine.init();
    eprintln!("Wine prefix: {:.1?}", started.elapsed());

    let manifests = Manifests {
        dir: tempfile::tempdir().expect("manifests dir"),
    };
    manifests.write("node.yaml", &node_yaml(&cl, 1));
    let all = ["a", "b", "c"];
    manifests.write("web.yaml", &web(&cl, &all).yaml());
    let sticky = Service::new("sticky", "10.96.0.12")
        .tcp(80)
        .affinity(60)
        .endpoints(&cl, &["a", "b", "c"]);
    manifests.write("sticky.yaml", &sticky.yaml());
    let lb = Service::new("lb", "10.96.0.13")
        .tcp(8080)
        .udp(8080)
        .load_balancer("198.51.100.30")
        .endpoints(&cl, &all);
    let unadded = Service::new("unadded", UNADDED_IP)
        .tcp(80)
        .endpoints(&cl, &["a"]);
    manifests.write("unadded.yaml", &unadded.yaml());
    manifests.write("lb.yaml", &lb.yaml());

    let healthz = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 10356);
    let mut launch = ProxyLaunch::new(cl.node_ns(), WINE64)
        .arg(&exe)
        .arg("--proxy-mode=winuserspace")
        .arg(format!(
            "--manifests={}",
            windows_path(manifests.dir.path())
        ))
        .arg(format!("--hostname-override={THIS_NODE}"))
        .arg(format!("--healthz-bind-address={healthz}"))
        .arg("--metrics-bind-address=127.0.0.1:10349")
        .arg("--iptables-min-sync-period=0s")
        .arg("-v=2")
        .env("INTERFACE_TO_ADD_SERVICE_IP", SERVICE_NIC)
        .env(
            "KUBE_PROXY_RS_STATE_DIR",
            windows_path(&work.path().join("state")),
        );
    wine.env(launch.command_mut());
    let mut proxy = launch.spawn().expect("start kube-proxy.exe under Wine");
    wait_log(&mut proxy, "the first sync", |l| l.contains(FIRST_SYNC_LOG));
    eprintln!("first sync after {:.1?}", proxy.started().elapsed());

    let client = cl.client();
    let ext = cl.external_in();
    let node_v4 = cl.node_ip();
    // Round robin over every endpoint, TCP and UDP, on every kind of service address.
    let checks: [(&str, &Host, IpAddr, u16); 5] = [
        ("ClusterIP", client, ip("10.96.0.10"), 80),
        ("externalIP", ext, ip("192.168.50.100"), 80),
        ("LoadBalancer IP", ext, ip("198.51.100.30"), 8080),
        ("NodePort TCP", ext, node_v4, 30080),
        ("NodePort from a pod", client, node_v4, 30080),
    ];
    for (what, from, dst, port) in checks {
        let tally = cl.tcp_repeat(from, dst, port, FLOWS).expect("probe");
        assert_answered_by(&format!("{what} TCP"), &tally, &all, &proxy);
        assert!(
            all.iter().all(|p| tally.count(p) == FLOWS / 3),
            "{what}: round robin gives each endpoint {} of {FLOWS}: {:?}",
            FLOWS / 3,
            tally.by_pod()
        );
    }
    let tally = cl.udp_repeat(ext, node_v4, 30081, FLOWS).expect("probe");
    assert_answered_by("NodePort UDP", &tally, &all, &proxy);

    // ClientIP affinity: one client, one pod.
    let tally = cl
        .tcp_repeat(client, ip("10.96.0.12"), 80, 6)
        .expect("probe");
    let pinned = tally.by_pod();
    assert!(
        pinned.len() == 1 && pinned.values().sum::<usize>() == 6,
        "ClientIP affinity must keep the client on one pod: {:?}",
        tally.outcomes()
    );

    // The service whose address is not on the node: its failure names address, interface
    // and the function Wine lacks.
    let reported = proxy.logged(|l| {
        l.contains(&format!("cannot add {UNADDED_IP} to interface"))
            && l.contains(SERVICE_NIC)
            && l.contains("CreateUnicastIpAddressEntry")
    });
    assert!(
        !reported.is_empty(),
        "no error for {UNADDED_IP}:\n{}",
        proxy.tail(80)
    );

    // /healthz answers.
    let health = http_get_path(&cl, cl.node(), healthz, "/healthz");
    assert_eq!(health.status, 200, "/healthz: {health:?}");

    // An endpoint that refuses is skipped: every connection still answered, none by b.
    cl.stop_echo("b").expect("stop pod b's echo server");
    let tally = cl
        .tcp_repeat(client, ip("10.96.0.10"), 80, FLOWS)
        .expect("probe");
    assert_answered_by("with b refusing", &tally, &["a", "c"], &proxy);

    // An edit of the manifests moves the traffic.
    proxy.mark();
    manifests.write("web.yaml", &web(&cl, &["c"]).yaml());
    wait_log(&mut proxy, "the sync of the edit", |l| {
        l.contains(SYNCED_LOG) && !l.contains("changed=\"0\"")
    });
    let tally = cl
        .tcp_repeat(client, ip("10.96.0.10"), 80, FLOWS)
        .expect("probe");
    assert_answered_by("after the edit", &tally, &["c"], &proxy);
    let tally = cl.udp_repeat(ext, node_v4, 30081, 3).expect("probe");
    assert_answered_by("NodePort UDP after the edit", &tally, &["c"], &proxy);

    // Ctrl-C: Wine turns SIGINT into the console's CTRL_C_EVENT.
    signal(proxy.pid(), "INT");
    let deadline = Instant::now() + PATIENCE;
    let status = loop {
        if let Some(status) = proxy.try_exit_status() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "no exit within {PATIENCE:?} of Ctrl-C:\n{}",
            proxy.tail(80)
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        status.success(),
        "exit after Ctrl-C: {status}\n{}",
        proxy.tail(80)
    );
    assert!(
        !proxy.logged(|l| l.contains("Ctrl-C received")).is_empty()
            && !proxy.logged(|l| l.contains("Shut down cleanly")).is_empty(),
        "a clean shutdown is logged:\n{}",
        proxy.tail(80)
    );
    eprintln!("Wine test total: {:.1?}", started.elapsed());
}
