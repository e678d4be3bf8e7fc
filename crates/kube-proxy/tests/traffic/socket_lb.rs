//! `--socket-lb` beside nftables mode, judged by traffic: the real proxy attaches the
//! programs to a cgroup v2 directory of the test's own, and the client pod's probes start
//! inside it, as a pod's processes would. Probes from the same pod outside the cgroup meet
//! nftables mode's rules (the control); conntrack in the node namespace tells the two paths
//! apart: a translated socket's flow goes to the endpoint from its first packet, so its
//! entry never holds the ClusterIP.
//!
//! The proxy runs under `ip netns exec`, which remounts `/sys` and so hides the host's
//! cgroup2 mount: the test mounts the hierarchy a second time outside `/sys`
//! ([`CgroupView`]) and names the test cgroup there with `--socket-lb-cgroup`. (It must never
//! attach to the root: the programs see every socket of the host, whatever its network
//! namespace, and other tests use the same ClusterIPs.)

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};

use kp_testbed::cgroup::{TestCgroup, cgroup2_root};
use kp_testbed::{Cluster, Outcome, Protocol, isolated};

use crate::support::{CLUSTER_CIDR_DUAL, CLUSTER_CIDR_V4, Env, Flags, Mode, Service, kube_proxy};

const CGROUP_PREFIX: &str = "kp-socklb-traffic-";
/// Flows whose conntrack entries are checked.
const FLOWS: usize = 30;
/// Connections for the balance check: a 2:1 skew (267/133) has chi-square 44.
const BALANCE_FLOWS: usize = 400;
/// Exceeded by a fair split over 2 endpoints (1 degree of freedom) with a probability below
/// 1e-6 (as kp-rules' `nft_layout_balance` bounds it: df + 10·sqrt(2·df) + 10).
const CHI2_BOUND: f64 = 25.1;
const WEB: &str = "10.96.0.10";
const ITP: &str = "10.96.0.11";
const EMPTY: &str = "10.96.0.13";
const STICKY: &str = "10.96.0.12";
/// Connections of the load a restart runs under, one every [`LOAD_INTERVAL`] at most: over
/// 10 s, longer than a restart takes (checked).
const LOAD_FLOWS: usize = 2000;
const LOAD_INTERVAL: std::time::Duration = std::time::Duration::from_millis(5);
/// Connections per client in the affinity check: one endpoint of two for all of them by
/// chance, without affinity, has probability 2^-19.
const STICKY_FLOWS: usize = 20;
const WEB6: &str = "fd00:10:96::10";
/// The UDP Service the resolver-like burst queries.
const DNS: &str = "10.96.0.20";
/// The burst: sockets of one client and queries on each (2,000 in all).
const BURST_SOCKETS: usize = 20;
const BURST_PER_SOCKET: usize = 100;
/// The IPv6 burst (480 queries; even, as queries go in pairs).
const BURST6_PER_SOCKET: usize = 24;
/// Sessions opened at most to find one the programs sent to endpoint a (each lands there
/// with probability 1/2).
const SESSION_TRIES: usize = 20;

fn ip(text: &str) -> IpAddr {
    text.parse().expect("literal address")
}

/// The cgroup v2 hierarchy mounted a second time in a directory of the test's own, where
/// processes under `ip netns exec` can still see it; unmounted on drop.
struct CgroupView {
    dir: tempfile::TempDir,
}

impl CgroupView {
    fn mount() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        run(&["mount", "-t", "cgroup2", "cgroup2"], dir.path());
        Self { dir }
    }

    /// Where `cgroup` appears in this view.
    fn path_of(&self, cgroup: &TestCgroup) -> PathBuf {
        let root = cgroup2_root().expect("a cgroup v2 mount");
        let relative = cgroup.path().strip_prefix(root).expect("under the root");
        self.dir.path().join(relative)
    }
}

impl Drop for CgroupView {
    fn drop(&mut self) {
        run(&["umount", "-l"], self.dir.path());
    }
}

fn run(args: &[&str], path: &Path) {
    let status = std::process::Command::new(args[0])
        .args(&args[1..])
        .arg(path)
        .status()
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(status.success(), "{args:?} {}: {status}", path.display());
}

/// Why this host cannot run the scenario (a failure instead under CI).
fn unavailable() -> Option<String> {
    cgroup2_root()
        .is_none()
        .then(|| "no cgroup v2 mount".to_owned())
}

/// conntrack's entries in the node namespace for flows from the client's port `sport`, in
/// the table of `client`'s family.
fn conntrack_from(env: &Env, protocol: &str, client: SocketAddr) -> String {
    let family = if client.is_ipv6() { "ipv6" } else { "ipv4" };
    let sport = client.port().to_string();
    env.node_exec(&[
        "conntrack",
        "-L",
        "-f",
        family,
        "-p",
        protocol,
        "--sport",
        &sport,
    ])
}

/// Asserts `outcome` was answered and its flow went to the endpoint from the start: a
/// conntrack entry exists for it and none holds the Service address `service`.
fn assert_not_natted(env: &Env, protocol: &str, outcome: &Outcome, service: &str) {
    let Outcome::Answered { client, server, .. } = outcome else {
        panic!("not answered: {outcome:?}{}", env.diag());
    };
    // The flow's family is the endpoint's: a dual-stack socket's IPv4 flow may report its
    // own address as `[::]` (bound to the wildcard).
    let flow = match server {
        SocketAddr::V4(_) => SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), client.port()),
        SocketAddr::V6(_) => *client,
    };
    let entries = conntrack_from(env, protocol, flow);
    assert!(
        entries.contains(&format!("dst={}", server.ip())) && !entries.contains(service),
        "{protocol} flow {client} -> {service}: conntrack must show the endpoint, not the \
         Service: {entries} ({outcome:?}){}",
        env.diag()
    );
}

/// The proxy with `--socket-lb` attached to a cgroup of the test's own (seen through a
/// [`CgroupView`]); fields drop in order: the proxy and cluster, the cgroup, the view.
struct Bed {
    env: Env,
    cgroup: TestCgroup,
    _view: CgroupView,
}

/// A cluster (dual-stack or IPv4) with `services` and the proxy in `mode` with
/// `--socket-lb`.
fn start(mode: Mode, dual_stack: bool, services: impl FnOnce(&Cluster) -> Vec<Service>) -> Bed {
    let view = CgroupView::mount();
    let cgroup = TestCgroup::create(CGROUP_PREFIX).expect("test cgroup");
    let c = crate::scenarios::cluster(dual_stack);
    let services = services(&c);
    let cidr = if dual_stack {
        CLUSTER_CIDR_DUAL
    } else {
        CLUSTER_CIDR_V4
    };
    let flags = Flags::cluster_cidr(cidr).flag("--socket-lb").flag(&format!(
        "--socket-lb-cgroup={}",
        view.path_of(&cgroup).display()
    ));
    let env = Env::start_with(mode, c, flags, &services, &[]);
    Bed {
        env,
        cgroup,
        _view: view,
    }
}

/// The scenario in `mode` (either nftables layout).
pub fn socket_lb(mode: Mode) {
    if isolated::skip("socket_lb", unavailable()) {
        return;
    }
    let Bed {
        mut env,
        cgroup,
        _view,
    } = start(mode, false, |c| {
        vec![
            Service::new("web", WEB)
                .tcp(80)
                .udp(80)
                .endpoints(c, &["a", "b"]),
            Service::new("itp", ITP)
                .tcp(80)
                .itp_local()
                .endpoints(c, &["a", "c"]),
            Service::new("empty", EMPTY)
                .tcp(80)
                .udp(80)
                .endpoints(c, &[]),
            Service::new("sticky", STICKY)
                .tcp(80)
                .affinity(600)
                .endpoints(c, &["a", "b"]),
        ]
    });
    let attached = env.logged(|l| l.contains("Socket load balancer attached"));
    assert_eq!(attached.len(), 1, "{}", env.diag());

    control_is_natted(&env);
    env.cluster.set_probe_cgroup(Some(cgroup.path().to_owned()));
    translated_tcp_and_udp(&env);
    mapped_ipv6_is_translated(&env);
    refused_and_local(&env);
    affinity_per_pod(&mut env);

    // A partial sync: web loses a; the programs follow at once, and the sockets they
    // connected to a are destroyed.
    let (mut udp, mut tcp) = (
        session_to_a(&env, Protocol::Udp),
        session_to_a(&env, Protocol::Tcp),
    );
    let web_b = Service::new("web", WEB)
        .tcp(80)
        .udp(80)
        .endpoints(&env.cluster, &["b"]);
    env.apply(&web_b);
    // The pass runs on the socket load balancer's thread, after the sync.
    env.proxy().wait_for("the sockets of a destroyed", |l| {
        l.contains("destroyed sockets of removed endpoints") && l.contains("destroyed=\"2\"")
    });
    let tally = env
        .cluster
        .tcp_repeat(env.cluster.client(), ip(WEB), 80, 10)
        .expect("probe");
    assert_eq!(tally.count("b"), 10, "{tally:?}{}", env.diag());
    udp_session_is_moved_to_b(&env, &mut udp);
    let after = tcp.send("after");
    assert!(
        matches!(after, Ok(Outcome::Closed) | Err(_)),
        "the TCP connection to a is reset: {after:?}{}",
        env.diag()
    );
    survives_restart_and_kill(&mut env);
    pins_removed_by_someone_else_come_back(&mut env);
    links_detached_by_someone_else_come_back(&mut env);
    entries_rewritten_by_someone_else_are_restored(&mut env);
    a_second_proxy_on_the_pins_is_refused(&mut env);
    let attaching = env.flags().clone();
    without_sock_destroy_udp_stays_with_nftables(&mut env);
    env.restart_with(attaching.clone());
    restarted_where_it_cannot_attach(&mut env);
    pins_removed_without_the_flag_and_by_cleanup(&mut env, attaching);
    env.cluster.set_probe_cgroup(None);
}

/// The pins go when the proxy starts without `--socket-lb`, and with `--cleanup`; they stay
/// after a clean stop (SIGTERM).
fn pins_removed_without_the_flag_and_by_cleanup(env: &mut Env, attaching: Flags) {
    let pins = kp_socklb::pin::pin_dir(Some(env.state_dir()));
    let link = kp_socklb::pin::link_pin(&pins, "kp_connect4");
    let map = kp_socklb::pin::map_pin(&pins, "kp_services");
    assert!(!link.exists(), "removed by the start that could not attach");
    env.restart_with(attaching.clone());
    assert!(link.exists() && map.exists(), "pinned again");
    env.restart_with(Flags::cluster_cidr(CLUSTER_CIDR_V4));
    assert!(!link.exists() && !map.exists(), "--socket-lb off: removed");
    let removed = env.logged(|l| l.contains("Removed the socket load balancer's pinned"));
    assert_eq!(removed.len(), 1, "{removed:?}{}", env.diag());
    env.restart_with(attaching);
    env.stop_proxy();
    assert!(link.exists(), "kept after SIGTERM");
    let state = env.state_env();
    env.node_exec(&[
        "env",
        &state,
        kube_proxy(),
        "--cleanup",
        "--proxy-mode=nftables",
    ]);
    assert!(!link.exists() && !map.exists(), "--cleanup: removed");
}

/// ClientIP affinity in the programs: each pod (its network namespace) keeps one endpoint,
/// without NAT; when that endpoint leaves the Service, the pod is pinned to another.
fn affinity_per_pod(env: &mut Env) {
    let pinned = |env: &Env, pod: &str| -> String {
        let cl = &env.cluster;
        let host = if pod == "client" {
            cl.client()
        } else {
            cl.pod(pod).expect("pod")
        };
        let tally = cl
            .tcp_repeat(host, ip(STICKY), 80, STICKY_FLOWS)
            .expect("probe");
        let (a, b) = (tally.count("a"), tally.count("b"));
        assert!(
            a == STICKY_FLOWS || b == STICKY_FLOWS,
            "{pod} not pinned: a {a}, b {b}{}",
            env.diag()
        );
        // Pods a and b may be pinned to themselves: such flows never leave the pod.
        if pod == "client" {
            for outcome in &tally.outcomes()[..3] {
                assert_not_natted(env, "tcp", outcome, STICKY);
            }
        }
        if a == STICKY_FLOWS { "a" } else { "b" }.to_owned()
    };
    for pod in ["client", "a", "b"] {
        pinned(env, pod);
    }
    let mine = pinned(env, "client");
    let other = if mine == "a" { "b" } else { "a" };
    let without = Service::new("sticky", STICKY)
        .tcp(80)
        .affinity(600)
        .endpoints(&env.cluster, &[other]);
    env.apply(&without);
    assert_eq!(pinned(env, "client"), other, "{mine} left: unpinned");
    let both = Service::new("sticky", STICKY)
        .tcp(80)
        .affinity(600)
        .endpoints(&env.cluster, &["a", "b"]);
    env.apply(&both);
    assert_eq!(pinned(env, "client"), other, "{other} stayed: still pinned");
}

/// The proxy restarted (SIGTERM), then killed (SIGKILL) and started again, each under a
/// load of connections: the pinned programs translate while no proxy runs and the next one
/// adopts them, so no connection fails and none meets nftables' DNAT.
fn survives_restart_and_kill(env: &mut Env) {
    let natted_ports = |env: &Env| -> BTreeSet<u16> {
        let entries = env.node_exec(&["conntrack", "-L", "-p", "tcp", "-d", WEB]);
        entries.lines().filter_map(sport).collect()
    };
    for kill in [false, true] {
        // NATed flows of earlier steps (the control) may share a port with the load's.
        let before = natted_ports(env);
        let client = env.cluster.client().clone();
        let load = env
            .cluster
            .tcp_repeat_in_background(
                &client,
                SocketAddr::new(ip(WEB), 80),
                LOAD_FLOWS,
                LOAD_INTERVAL,
            )
            .expect("probe");
        if kill {
            env.kill_and_restart_proxy();
        } else {
            env.restart_proxy();
        }
        assert!(
            !load.is_finished(),
            "the load ended before the restart did: make it longer"
        );
        let tally = load.join().expect("probe thread").expect("probe");
        let how = if kill { "SIGKILL" } else { "restart" };
        assert_eq!(
            tally.count("b"),
            LOAD_FLOWS,
            "{how}: {tally:?}{}",
            env.diag()
        );
        let ports: BTreeSet<u16> = tally
            .outcomes()
            .iter()
            .filter_map(|o| match o {
                Outcome::Answered { client, .. } => Some(client.port()),
                _ => None,
            })
            .collect();
        let hits: Vec<u16> = natted_ports(env)
            .difference(&before)
            .filter(|p| ports.contains(p))
            .copied()
            .collect();
        assert!(
            hits.is_empty(),
            "{how}: NATed flows of the load from ports {hits:?}"
        );
        let attached = env.logged(|l| l.contains("Socket load balancer attached"));
        assert!(
            attached.iter().any(|l| l.contains("adopted=")) && !attached[0].contains("adopted=0"),
            "{how}: the maps adopted: {attached:?}"
        );
    }
}

/// Someone removes the pinned links (so the programs detach) and a map's pin: the canary
/// check reports each as a foreign change (logged, counted), the full sync after it puts
/// them back, and new connections are translated again.
fn pins_removed_by_someone_else_come_back(env: &mut Env) {
    let pins = kp_socklb::pin::pin_dir(Some(env.state_dir()));
    env.proxy().mark();
    for (name, _) in kp_socklb::program::PROGRAMS {
        std::fs::remove_file(kp_socklb::pin::link_pin(&pins, name)).expect("unpin a link");
    }
    std::fs::remove_file(kp_socklb::pin::map_pin(&pins, "kp_slots")).expect("unpin a map");
    let found = env.proxy().wait_for("the removed pins reported", |l| {
        l.contains("removed by another program") && l.contains("kp_connect4 detached")
    });
    assert!(found.contains("restoring"), "{found}");
    env.proxy().wait_for("the pins restored", |l| {
        l.contains("Socket load balancer pins restored")
    });
    for (name, _) in kp_socklb::program::PROGRAMS {
        assert!(
            kp_socklb::pin::link_pin(&pins, name).exists(),
            "{name} pinned again"
        );
    }
    assert!(kp_socklb::pin::map_pin(&pins, "kp_slots").exists());
    web_is_translated(env);
    // One check's findings are one event, counted under its first (a link).
    let metrics = env.metrics();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("kube_proxy_rs_foreign_changes_total")
                && l.contains("what=\"bpf-link\"")),
        "counted: {metrics}"
    );
}

/// Someone detaches the pinned links from the cgroup and leaves their pins (as `bpftool
/// link detach` does): the canary check notices (logged, counted under `bpf-link`), the
/// full sync after it attaches new links, and new connections are translated again.
fn links_detached_by_someone_else_come_back(env: &mut Env) {
    let pins = kp_socklb::pin::pin_dir(Some(env.state_dir()));
    let before = foreign_changes(env, "bpf-link");
    env.proxy().mark();
    for (name, _) in kp_socklb::program::PROGRAMS {
        kp_testbed::cgroup::detach_link(&kp_socklb::pin::link_pin(&pins, name)).expect("detach");
    }
    let found = env.proxy().wait_for("the detached links reported", |l| {
        l.contains("changed by another program") && l.contains("kp_connect4 detached from its")
    });
    assert!(found.contains("restoring"), "{found}");
    env.proxy().wait_for("the links attached again", |l| {
        l.contains("Socket load balancer pins restored")
    });
    web_is_translated(env);
    let after = foreign_changes(env, "bpf-link");
    assert!(after > before, "counted: {before} -> {after}");
}

/// A second proxy with `--socket-lb` on the same pins while the first runs: it fails
/// start-up naming the first (its pid), and the first's pins and translation are untouched.
fn a_second_proxy_on_the_pins_is_refused(env: &mut Env) {
    let first = env.proxy().pid();
    let pins = kp_socklb::pin::pin_dir(Some(env.state_dir()));
    let flags = env.flags().clone();
    let (status, log) = env.second_proxy_exit(&flags);
    assert!(!status.success(), "{status}: {log}");
    assert!(
        log.contains(&format!("are in use by pid {first} (")) && log.contains("one proxy per pin"),
        "{log}"
    );
    assert!(
        !log.contains("Socket load balancer attached"),
        "attached nothing: {log}"
    );
    for (name, _) in kp_socklb::program::PROGRAMS {
        assert!(
            kp_socklb::pin::link_pin(&pins, name).exists(),
            "{name} pinned"
        );
    }
    web_is_translated(env);
    let metrics = env.metrics();
    assert!(
        metrics.contains("kube_proxy_rs_socket_lb_attached 1"),
        "the first still attached: {metrics}"
    );
}

/// The proxy restarted believing the kernel lacks `bpf_sock_destroy` (the test build's
/// hook): it says so once, its gauge says 0, UDP Services are left to nftables mode (DNAT,
/// seen in conntrack) while TCP is still translated, and a connected UDP session to an
/// endpoint that leaves moves to the remaining one through nftables mode's conntrack flush.
fn without_sock_destroy_udp_stays_with_nftables(env: &mut Env) {
    let flags = env
        .flags()
        .clone()
        .env(kp_socklb::destroy::fault::NO_KFUNC_ENV, "1");
    env.restart_with(flags);
    let said = env.logged(|l| l.contains("cannot destroy sockets of removed endpoints"));
    assert_eq!(said.len(), 1, "{said:?}{}", env.diag());
    assert!(said[0].contains("no bpf_sock_destroy kfunc"), "{said:?}");
    let metrics = env.metrics();
    assert!(
        metrics.contains("kube_proxy_rs_socket_lb_sockets_destroyable 0"),
        "{metrics}"
    );
    let both = Service::new("web", WEB)
        .tcp(80)
        .udp(80)
        .endpoints(&env.cluster, &["a", "b"]);
    env.apply(&both);
    let cl = &env.cluster;
    let tcp = cl.tcp(cl.client(), ip(WEB), 80).expect("probe");
    assert_not_natted(env, "tcp", &tcp, WEB);
    let client = cl.client().clone();
    let mut session = (0..SESSION_TRIES)
        .map(|_| cl.connect_udp(&client, ip(WEB), 80).expect("session"))
        .find(|s| s.greeting().answered_by("a"))
        .unwrap_or_else(|| panic!("no UDP session to a{}", env.diag()));
    assert_natted(env, "udp", session.greeting());
    let only_b = Service::new("web", WEB)
        .tcp(80)
        .udp(80)
        .endpoints(&env.cluster, &["b"]);
    env.apply(&only_b);
    let moved = session.send("after").expect("udp session");
    assert!(moved.answered_by("b"), "{moved:?}{}", env.diag());
    assert_natted(env, "udp", &moved);
}

/// 10 TCP connections from the client to WEB, each answered without NAT. NATed entries of
/// earlier steps (the control, a fallback) are deleted first: a new flow reusing one's source
/// port would otherwise find it beside its own.
fn web_is_translated(env: &Env) {
    // Exit status 1 when there is none.
    let _ = env
        .cluster
        .exec(env.cluster.node_ns(), &["conntrack", "-D", "-d", WEB]);
    let tally = env
        .cluster
        .tcp_repeat(env.cluster.client(), ip(WEB), 80, 10)
        .expect("probe");
    for outcome in tally.outcomes() {
        assert_not_natted(env, "tcp", outcome, WEB);
    }
}

/// Asserts `outcome` was answered through nftables mode's DNAT: its conntrack entry holds
/// the Service address.
fn assert_natted(env: &Env, protocol: &str, outcome: &Outcome) {
    let Outcome::Answered { client, .. } = outcome else {
        panic!("not answered: {outcome:?}{}", env.diag());
    };
    let entries = conntrack_from(env, protocol, *client);
    assert!(
        entries.contains(WEB),
        "{protocol} from {client}: nftables' DNAT: {entries}{}",
        env.diag()
    );
}

/// `kube_proxy_rs_foreign_changes_total{what=...}` (0 before the first).
fn foreign_changes(env: &Env, what: &str) -> f64 {
    let label = format!("what=\"{what}\"");
    env.metrics()
        .lines()
        .filter(|l| l.starts_with("kube_proxy_rs_foreign_changes_total") && l.contains(&label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Rewrites the address of every slot of the TCP Service port `service:port` in the pinned
/// `kp_slots` to `to` (keeping the port), as another process's `BPF_MAP_UPDATE_ELEM` would:
/// perl's `syscall`, as `kp_testbed::cgroup::detach_link` does. Arguments: the bpf
/// syscall's number, the two pins, the Service key's and the address's bytes in hex.
/// Prints the slots rewritten.
const REWRITE_SLOTS: &str = r#"
my ($nr, $services, $slots, $key_hex, $addr_hex) = @ARGV;
sub obj_get {
    my $get = pack("Q L L l", unpack("Q", pack("p", $_[0])), 0, 0, 0);
    my $fd = syscall($nr, 7, $get, length($get));
    die "BPF_OBJ_GET $_[0]: $!\n" if $fd < 0;
    return $fd;
}
# cmd 1 BPF_MAP_LOOKUP_ELEM (fills $_[3]), 2 BPF_MAP_UPDATE_ELEM.
sub elem {
    my ($cmd, $fd) = @_;
    my $attr = pack("L L Q Q Q", $fd, 0, unpack("Q", pack("p", $_[2])),
        unpack("Q", pack("p", $_[3])), 0);
    syscall($nr, $cmd, $attr, length($attr)) == 0 or die "bpf($cmd): $!\n";
}
my ($svc, $slot) = (obj_get($services), obj_get($slots));
my $key = pack("H*", $key_hex);
my $entry = "\0" x 12;
elem(1, $svc, $key, $entry);
my ($id, $count) = unpack("L L", $entry);
for my $i (0 .. $count - 1) {
    my $k = pack("L L", $id, $i);
    my $v = "\0" x 8;
    elem(1, $slot, $k, $v);
    substr($v, 0, 4) = pack("H*", $addr_hex);
    elem(2, $slot, $k, $v);
}
print "$count\n";
"#;

fn rewrite_slots(pins: &Path, service: &str, port: u16, to: Ipv4Addr) -> usize {
    let nr = kp_testbed::cgroup::bpf_syscall().expect("a bpf syscall number here");
    let IpAddr::V4(service) = ip(service) else {
        unreachable!("an IPv4 Service")
    };
    let hex = |bytes: &[u8]| bytes.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let mut key = service.octets().to_vec();
    key.extend(port.to_be_bytes());
    key.extend([6, 0]);
    let output = std::process::Command::new("perl")
        .args(["-e", REWRITE_SLOTS, nr])
        .arg(kp_socklb::pin::map_pin(pins, "kp_services"))
        .arg(kp_socklb::pin::map_pin(pins, "kp_slots"))
        .args([hex(&key), hex(&to.octets())])
        .output()
        .expect("perl");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "rewrite: {stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout.trim().parse().expect("the slots rewritten")
}

/// Someone rewrites web's slots (endpoint b) in the pinned maps to pod c, no endpoint of
/// web: the thorough check before the next periodic sync (1 s here) reports it as a
/// foreign change (logged, counted under `bpf-map`), and that sync restores the slots, so
/// new connections reach b again, without NAT.
fn entries_rewritten_by_someone_else_are_restored(env: &mut Env) {
    let back = env.flags().clone();
    env.restart_with(back.clone().flag("--iptables-sync-period=1s"));
    let before = foreign_changes(env, "bpf-map");
    let pins = kp_socklb::pin::pin_dir(Some(env.state_dir()));
    let c = env.cluster.pod("c").expect("pod c").ipv4();
    env.proxy().mark();
    assert_eq!(rewrite_slots(&pins, WEB, 80, c), 1, "web's one slot (b)");
    let found = env.proxy().wait_for("the rewritten entries reported", |l| {
        l.contains("changed by another program") && l.contains("map entries of")
    });
    assert!(
        found.contains("10.96.0.10:80/tcp") && found.contains("restoring"),
        "{found}"
    );
    let restored = (0..20).find_map(|_| {
        let tally = env
            .cluster
            .tcp_repeat(env.cluster.client(), ip(WEB), 80, 10)
            .expect("probe");
        if tally.count("b") == 10 {
            return Some(tally);
        }
        std::thread::sleep(std::time::Duration::from_millis(250));
        None
    });
    let tally = restored.unwrap_or_else(|| panic!("web's slot not restored{}", env.diag()));
    for outcome in tally.outcomes() {
        assert_not_natted(env, "tcp", outcome, WEB);
    }
    let after = foreign_changes(env, "bpf-map");
    assert!(after > before, "counted: {before} -> {after}");
    env.restart_with(back);
}

/// The first `sport=` of a conntrack line (the original direction's).
fn sport(line: &str) -> Option<u16> {
    line.split_whitespace()
        .find_map(|f| f.strip_prefix("sport="))
        .and_then(|p| p.parse().ok())
}

/// A long-lived `protocol` session from the client (inside the cgroup) that the programs sent
/// to endpoint a, without NAT.
fn session_to_a(env: &Env, protocol: Protocol) -> kp_testbed::Session {
    let client = env.cluster.client().clone();
    for _ in 0..SESSION_TRIES {
        let session = match protocol {
            Protocol::Udp => env.cluster.connect_udp(&client, ip(WEB), 80),
            _ => env.cluster.connect(&client, ip(WEB), 80),
        }
        .expect("session");
        if session.greeting().answered_by("a") {
            assert_not_natted(env, &protocol.to_string(), session.greeting(), WEB);
            return session;
        }
    }
    panic!(
        "{SESSION_TRIES} {protocol} sessions, none to a{}",
        env.diag()
    );
}

/// The connected UDP socket to the removed endpoint a: its next call fails (destroyed:
/// ECONNABORTED, disconnected), the application connects again and reaches b; never a.
fn udp_session_is_moved_to_b(env: &Env, session: &mut kp_testbed::Session) {
    let mut outcomes = Vec::new();
    for i in 0..3 {
        let outcome = session.send(&format!("after-{i}")).expect("udp session");
        let moved = outcome.answered_by("b");
        outcomes.push(outcome);
        if moved {
            break;
        }
    }
    assert!(
        outcomes.iter().all(|o| !o.answered_by("a")),
        "still sent to the removed endpoint: {outcomes:?}{}",
        env.diag()
    );
    let last = outcomes.last().expect("three tries");
    assert!(last.answered_by("b"), "{outcomes:?}{}", env.diag());
    assert_not_natted(env, "udp", last, WEB);
}

/// A dual-stack cluster with `--socket-lb`: an IPv6 Service's TCP and UDP translated without
/// NAT (`getpeername` and `recvfrom` show the Service), then 2,000 resolver-like queries from
/// 20 sockets of one client to a UDP Service: every one answered within the probe timeout
/// (no 5 s stall), every answer from the Service address, no conntrack entry holding it.
pub fn ipv6_and_dns_burst(mode: Mode) {
    if isolated::skip("socket_lb ipv6 and dns", unavailable()) {
        return;
    }
    let Bed { env, cgroup, .. } = start(mode, true, |c| {
        vec![
            Service::new("web6", WEB6)
                .tcp(80)
                .udp(80)
                .endpoints(c, &["a", "b"]),
            Service::new("dns", DNS).udp(80).endpoints(c, &["a", "b"]),
        ]
    });
    env.cluster.set_probe_cgroup(Some(cgroup.path().to_owned()));
    ipv6_translated(&env);
    dns_burst(&env, SocketAddr::new(ip(DNS), 80), BURST_PER_SOCKET);
    dns_burst(&env, SocketAddr::new(ip(WEB6), 80), BURST6_PER_SOCKET);
    env.cluster.set_probe_cgroup(None);
}

fn ipv6_translated(env: &Env) {
    let cl = &env.cluster;
    let client = cl.client();
    let tally = cl.tcp_repeat(client, ip(WEB6), 80, FLOWS).expect("probe");
    assert_eq!(
        tally.count("a") + tally.count("b"),
        FLOWS,
        "{tally:?}{}",
        env.diag()
    );
    assert!(tally.count("a") > 0 && tally.count("b") > 0, "{tally:?}");
    for outcome in tally.outcomes() {
        assert_not_natted(env, "tcp", outcome, WEB6);
    }
    peers_show_the_service(env, WEB6);
}

/// [`BURST_SOCKETS`] sockets × `per_socket` queries to `service`: all answered, from the
/// Service address, by both endpoints, and conntrack holds no entry to the Service.
fn dns_burst(env: &Env, service: SocketAddr, per_socket: usize) {
    let client = env.cluster.client();
    let report = env
        .cluster
        .udp_burst(client, service, BURST_SOCKETS, per_socket)
        .expect("burst");
    let sent = BURST_SOCKETS * per_socket;
    assert_eq!(
        (
            report.sent,
            report.answered,
            report.timed_out,
            report.wrong_source
        ),
        (sent, sent, 0, 0),
        "{service}: {report:?}{}",
        env.diag()
    );
    assert!(report.errors.is_empty(), "{report:?}");
    assert_eq!(report.pods.len(), 2, "both endpoints answer: {report:?}");
    let family = if service.is_ipv6() { "ipv6" } else { "ipv4" };
    let dst = service.ip().to_string();
    let natted = env.node_exec(&["conntrack", "-L", "-f", family, "-p", "udp", "-d", &dst]);
    assert!(
        !natted.contains(&dst),
        "no conntrack entry holds the Service address: {natted}{}",
        env.diag()
    );
    let all = env.node_exec(&["conntrack", "-L", "-f", family, "-p", "udp"]);
    let to_endpoints = all.lines().filter(|l| l.contains("dport=80")).count();
    assert!(
        to_endpoints >= BURST_SOCKETS,
        "the flows went to the endpoints: {all}"
    );
    eprintln!(
        "socket_lb dns burst to {service}: {} queries, slowest pair {} ms",
        report.sent, report.slowest_ms
    );
}

/// The proxy restarted with a directory that is not cgroup v2: the old programs went with
/// the old process, yet a connection they translated goes on (it needs no state); the new
/// proxy says why once and nftables mode's rules serve new connections.
fn restarted_where_it_cannot_attach(env: &mut Env) {
    let client = env.cluster.client().clone();
    let mut session = env.cluster.connect(&client, ip(WEB), 80).expect("session");
    assert_not_natted(env, "tcp", session.greeting(), WEB);
    let bad = Flags::cluster_cidr(CLUSTER_CIDR_V4)
        .flag("--socket-lb")
        .flag("--socket-lb-cgroup=/proc");
    env.restart_with(bad);
    let reply = session.send("still there").expect("send");
    assert!(reply.answered_by("b"), "{reply:?}{}", env.diag());
    let unavailable = env.logged(|l| l.contains("Socket load balancer unavailable"));
    assert_eq!(unavailable.len(), 1, "{unavailable:?}{}", env.diag());
    assert!(
        unavailable[0].contains("/proc is not a cgroup v2 directory"),
        "{unavailable:?}"
    );
    let outcome = env.cluster.tcp(&client, ip(WEB), 80).expect("probe");
    let Outcome::Answered { client: from, .. } = &outcome else {
        panic!(
            "not answered by nftables mode alone: {outcome:?}{}",
            env.diag()
        );
    };
    let entries = conntrack_from(env, "tcp", *from);
    assert!(
        entries.contains(WEB),
        "nftables' DNAT: {entries}{}",
        env.diag()
    );
}

/// `getpeername()` (TCP) and `recvfrom()`'s source (unconnected UDP) show `service`'s
/// address, and neither flow was NATed.
fn peers_show_the_service(env: &Env, service: &str) {
    peers_show(env, SocketAddr::new(ip(service), 80), service);
}

/// Flows to `addr` (a form of `service`'s address): `getpeername()` (TCP) and `recvfrom()`'s
/// source (unconnected UDP) show `addr` as the application asked for it, and neither flow
/// was NATed.
fn peers_show(env: &Env, addr: SocketAddr, service: &str) {
    let (cl, client) = (&env.cluster, env.cluster.client());
    for protocol in [Protocol::Tcp, Protocol::Udp] {
        let report = cl.peer(client, protocol, addr).expect("peer probe");
        assert_eq!(
            report.peer,
            Some(addr),
            "{protocol}: {report:?}{}",
            env.diag()
        );
        assert_not_natted(env, &protocol.to_string(), &report.outcome, service);
    }
}

/// A dual-stack socket (AF_INET6 without IPV6_V6ONLY) reaching the IPv4 ClusterIP as
/// `::ffff:10.96.0.10` (`connect6`; unconnected UDP's `sendmsg4` then `recvmsg6`): TCP and
/// connected UDP reach an endpoint without NAT, and `getpeername()` / `recvfrom()` show
/// the mapped Service address.
fn mapped_ipv6_is_translated(env: &Env) {
    let cl = &env.cluster;
    let client = cl.client();
    let IpAddr::V4(web) = ip(WEB) else {
        unreachable!("WEB is IPv4")
    };
    let mapped = IpAddr::V6(web.to_ipv6_mapped());
    let tally = cl.tcp_repeat(client, mapped, 80, 10).expect("probe");
    assert_eq!(
        tally.count("a") + tally.count("b"),
        10,
        "{tally:?}{}",
        env.diag()
    );
    for outcome in tally.outcomes() {
        assert_not_natted(env, "tcp", outcome, WEB);
    }
    let udp = cl.udp(client, mapped, 80).expect("probe");
    assert_not_natted(env, "udp", &udp, WEB);
    peers_show(env, SocketAddr::new(mapped, 80), WEB);
}

/// Pearson's statistic of `counts` against equally likely endpoints.
fn chi_square(counts: &[usize]) -> f64 {
    let total: usize = counts.iter().sum();
    let expected = total as f64 / counts.len() as f64;
    counts
        .iter()
        .map(|&c| (c as f64 - expected).powi(2) / expected)
        .sum()
}

/// Outside the cgroup, nftables mode's DNAT: conntrack holds the ClusterIP.
fn control_is_natted(env: &Env) {
    let outcome = env
        .cluster
        .tcp(env.cluster.client(), ip(WEB), 80)
        .expect("probe");
    let Outcome::Answered { client, .. } = outcome else {
        panic!("control not answered: {outcome:?}{}", env.diag());
    };
    let entries = conntrack_from(env, "tcp", client);
    assert!(entries.contains(WEB), "control: {entries}{}", env.diag());
}

/// Inside: both endpoints answer, evenly (chi-square), no NAT; getpeername and UDP replies show the Service.
fn translated_tcp_and_udp(env: &Env) {
    let cl = &env.cluster;
    let client = cl.client();
    let tally = cl
        .tcp_repeat(client, ip(WEB), 80, BALANCE_FLOWS)
        .expect("probe");
    let (a, b) = (tally.count("a"), tally.count("b"));
    assert_eq!(a + b, BALANCE_FLOWS, "{tally:?}{}", env.diag());
    let chi2 = chi_square(&[a, b]);
    assert!(chi2 <= CHI2_BOUND, "a {a}, b {b}: chi-square {chi2:.1}");
    for outcome in &tally.outcomes()[..FLOWS] {
        assert_not_natted(env, "tcp", outcome, WEB);
    }
    peers_show_the_service(env, WEB);
}

/// No endpoints: refused, as nftables mode rejects; internalTrafficPolicy Local: only the
/// local endpoint, still without NAT.
fn refused_and_local(env: &Env) {
    let cl = &env.cluster;
    let client = cl.client();
    assert_eq!(
        cl.tcp(client, ip(EMPTY), 80).expect("probe"),
        Outcome::Refused
    );
    assert_eq!(
        cl.udp(client, ip(EMPTY), 80).expect("probe"),
        Outcome::Refused
    );
    let tally = cl.tcp_repeat(client, ip(ITP), 80, 10).expect("probe");
    assert_eq!(tally.count("a"), 10, "{tally:?}{}", env.diag());
    for outcome in tally.outcomes() {
        assert_not_natted(env, "tcp", outcome, ITP);
    }
}
