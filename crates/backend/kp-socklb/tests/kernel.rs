//! The programs in this kernel, judged by traffic. Each test runs in a throwaway network
//! namespace (`kp_testbed::isolated::run`) with endpoints on loopback, nftables mode's
//! kind of DNAT rule for the same Service address, and a cgroup v2 directory of its own
//! (`kp_testbed::cgroup::TestCgroup`, removed on drop) that the programs are attached to.
//! The test process enters the cgroup after making its control sockets: those meet the
//! nftables rule, sockets made inside meet the programs, and each answer names its endpoint.

use std::io::{BufRead, BufReader, ErrorKind};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::time::Duration;

use kp_core::model::Protocol;
use kp_socklb::program::PROGRAMS;
use kp_socklb::{
    Balancer, KernelMaps, LoadError, MissingPin, ServiceKey, SocketPrograms, Unavailable, pin,
};
use kp_testbed::cgroup::{TestCgroup, cgroup2_root};
use kp_testbed::isolated::{self, sh};

/// Endpoint "a", where the programs send the Service.
const A: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 3);
/// Endpoint "b", where nftables mode's rule sends it.
const B: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 4);
/// Endpoint "c", for the affinity test.
const C: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 5);
const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
/// A Service port without endpoints.
const EMPTY_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 11);
/// Endpoint "a" and a ClusterIP of an IPv6 Service.
const A6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 3);
const CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x10);
const EMPTY_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x11);
const CGROUP_PREFIX: &str = "kp-socklb-test-";
const WAIT: Duration = Duration::from_secs(2);

fn unavailable() -> Option<String> {
    isolated::missing(
        &["nft", "conntrack", "perl"],
        &["ip", "link", "add", "kpv0", "type", "veth"],
    )
    .or_else(|| {
        cgroup2_root()
            .is_none()
            .then(|| "no cgroup v2 mount".to_owned())
    })
}

/// Endpoints a and b on loopback, Service addresses routed out of a veth whose peer drops
/// them (so a socket outside the cgroup reaches nftables' rule, and an untranslated SYN
/// vanishes), and the rule DNATing the ClusterIP to b.
fn node() {
    sh(
        "ip link set lo up && ip addr add 10.244.1.3/32 dev lo && ip addr add 10.244.1.4/32 dev lo \
        && ip link add kpv0 type veth peer name kpv1 && ip link set kpv0 up && ip link set kpv1 up \
        && ip route add 10.96.0.0/16 dev kpv0",
    );
    sh("nft -f - <<'EOF'
table ip kpt {
  chain out {
    type nat hook output priority -100;
    ip daddr 10.96.0.10 tcp dport 80 dnat to 10.244.1.4:8080
    ip daddr 10.96.0.10 udp dport 53 dnat to 10.244.1.4:5353
  }
}
EOF");
    for endpoint in [A, B] {
        tcp_server(at(endpoint, 8080));
        udp_server(at(endpoint, 5353));
    }
}

/// Greets each connection with its own address.
fn tcp_server(addr: SocketAddr) {
    let listener = TcpListener::bind(addr).expect("bind endpoint");
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let mut stream = stream;
            let _ = std::io::Write::write_all(&mut stream, format!("{addr}\n").as_bytes());
        }
    });
}

/// Answers each datagram with its own address.
fn udp_server(addr: SocketAddr) {
    let socket = UdpSocket::bind(addr).expect("bind endpoint");
    std::thread::spawn(move || {
        let mut buf = [0u8; 64];
        while let Ok((_, from)) = socket.recv_from(&mut buf) {
            let _ = socket.send_to(addr.to_string().as_bytes(), from);
        }
    });
}

/// Who answered a TCP connection to `addr`, and the connection's local port.
fn tcp_answer(addr: SocketAddr) -> (String, TcpStream) {
    let stream = TcpStream::connect_timeout(&addr, WAIT).expect("connect");
    stream.set_read_timeout(Some(WAIT)).expect("timeout");
    let mut line = String::new();
    BufReader::new(&stream)
        .read_line(&mut line)
        .expect("greeting");
    (line.trim().to_owned(), stream)
}

/// Programs loaded and attached to a fresh cgroup, and their maps.
struct Attached {
    cgroup: TestCgroup,
    programs: SocketPrograms,
    lb: Balancer<KernelMaps>,
}

fn attach() -> Attached {
    let cgroup = TestCgroup::create(CGROUP_PREFIX).expect("test cgroup");
    let (mut programs, maps) = SocketPrograms::load().expect("load programs");
    programs.attach(cgroup.path()).expect("attach");
    Attached {
        cgroup,
        programs,
        lb: Balancer::new(maps),
    }
}

fn at(ip: impl Into<IpAddr>, port: u16) -> SocketAddr {
    SocketAddr::new(ip.into(), port)
}

fn service(ip: impl Into<IpAddr>, port: u16, protocol: Protocol) -> ServiceKey {
    ServiceKey::new(at(ip, port), protocol)
}

/// conntrack's entries for flows from local port `sport` (one line each).
fn conntrack_from(protocol: &str, sport: u16) -> Vec<String> {
    sh(&format!(
        "conntrack -L -p {protocol} --sport {sport} 2>/dev/null"
    ))
    .lines()
    .map(str::to_owned)
    .collect()
}

#[test]
fn tcp_to_a_cluster_ip_reaches_the_endpoint_without_nat() {
    isolated::run(
        "tcp_to_a_cluster_ip_reaches_the_endpoint_without_nat",
        unavailable,
        || {
            node();
            let svc = at(CLUSTER_IP, 80);
            // The control: outside the cgroup, nftables' DNAT to b, seen by conntrack.
            let (who, control) = tcp_answer(svc);
            assert_eq!(who, "10.244.1.4:8080");
            let sport = control.local_addr().expect("local").port();
            let natted = conntrack_from("tcp", sport).join("\n");
            assert!(natted.contains("dst=10.96.0.10"), "{natted}");
            assert!(natted.contains("src=10.244.1.4"), "{natted}");

            let mut node = attach();
            let a = at(A, 8080);
            node.lb
                .set(service(CLUSTER_IP, 80, Protocol::Tcp), &[a])
                .expect("set");
            node.cgroup.enter().expect("enter cgroup");
            let (who, stream) = tcp_answer(svc);
            assert_eq!(who, a.to_string(), "translated by connect4, not nftables");
            // getpeername4: the application sees the Service address.
            assert_eq!(stream.peer_addr().expect("peer"), svc);
            let sport = stream.local_addr().expect("local").port();
            let entries = conntrack_from("tcp", sport);
            assert_eq!(entries.len(), 1, "{entries:?}");
            assert!(entries[0].contains("dst=10.244.1.3 sport"), "{entries:?}");
            assert!(
                !entries[0].contains("10.96.0.10"),
                "no NAT entry: {entries:?}"
            );
        },
    );
}

#[test]
fn udp_replies_come_from_the_service_address() {
    isolated::run(
        "udp_replies_come_from_the_service_address",
        unavailable,
        || {
            node();
            let svc = at(CLUSTER_IP, 53);
            let a = at(A, 5353);
            let mut node = attach();
            node.lb
                .set(service(CLUSTER_IP, 53, Protocol::Udp), &[a])
                .expect("set");
            node.cgroup.enter().expect("enter cgroup");

            // Unconnected: sendmsg4 translates each datagram, recvmsg4 shows the Service.
            let socket = UdpSocket::bind("0.0.0.0:0").expect("bind");
            socket.set_read_timeout(Some(WAIT)).expect("timeout");
            let mut buf = [0u8; 64];
            for _ in 0..3 {
                socket.send_to(b"q", svc).expect("send_to");
                let (len, from) = socket.recv_from(&mut buf).expect("reply");
                assert_eq!(
                    &buf[..len],
                    a.to_string().as_bytes(),
                    "sent to a by sendmsg4"
                );
                assert_eq!(from, svc, "reply shown from the Service");
            }
            let sport = socket.local_addr().expect("local").port();
            let entries = conntrack_from("udp", sport);
            assert_eq!(entries.len(), 1, "{entries:?}");
            assert!(
                !entries[0].contains("10.96.0.10"),
                "no NAT entry: {entries:?}"
            );

            // Connected: connect4 translates once, getpeername4 shows the Service.
            let connected = UdpSocket::bind("0.0.0.0:0").expect("bind");
            connected.set_read_timeout(Some(WAIT)).expect("timeout");
            connected.connect(svc).expect("connect");
            assert_eq!(connected.peer_addr().expect("peer"), svc);
            connected.send(b"q").expect("send");
            let len = connected.recv(&mut buf).expect("reply");
            assert_eq!(&buf[..len], a.to_string().as_bytes());
        },
    );
}

#[test]
fn a_service_without_endpoints_is_refused() {
    isolated::run(
        "a_service_without_endpoints_is_refused",
        unavailable,
        || {
            node();
            let mut node = attach();
            node.lb
                .set(service(EMPTY_IP, 80, Protocol::Tcp), &[])
                .expect("set");
            node.lb
                .set(service(EMPTY_IP, 53, Protocol::Udp), &[])
                .expect("set");
            node.cgroup.enter().expect("enter cgroup");
            // Without the programs the SYN would vanish out of the veth (timed out).
            let tcp = TcpStream::connect_timeout(&at(EMPTY_IP, 80), WAIT);
            let error = tcp.expect_err("refused");
            assert_eq!(error.kind(), ErrorKind::ConnectionRefused, "{error}");
            let socket = UdpSocket::bind("0.0.0.0:0").expect("bind");
            let error = socket.send_to(b"q", at(EMPTY_IP, 53)).expect_err("refused");
            assert_eq!(error.kind(), ErrorKind::ConnectionRefused, "{error}");
            let error = socket.connect(at(EMPTY_IP, 53)).expect_err("refused");
            assert_eq!(error.kind(), ErrorKind::ConnectionRefused, "{error}");
        },
    );
}

#[test]
fn connections_spread_over_the_endpoints_and_follow_updates() {
    isolated::run(
        "connections_spread_over_the_endpoints_and_follow_updates",
        unavailable,
        || {
            node();
            let svc = at(EMPTY_IP, 80);
            let (a, b) = (at(A, 8080), at(B, 8080));
            let key = service(EMPTY_IP, 80, Protocol::Tcp);
            let mut node = attach();
            node.lb.set(key, &[a, b]).expect("set");
            node.cgroup.enter().expect("enter cgroup");
            // 64 connections all to one endpoint: probability 2^-63 if both are picked.
            let answers: Vec<String> = (0..64).map(|_| tcp_answer(svc).0).collect();
            for endpoint in [a, b] {
                let hits = answers
                    .iter()
                    .filter(|w| **w == endpoint.to_string())
                    .count();
                assert!(hits > 0, "{endpoint} never picked: {answers:?}");
            }
            node.lb.set(key, &[b]).expect("set");
            for _ in 0..16 {
                assert_eq!(tcp_answer(svc).0, b.to_string());
            }
            node.lb.remove(key).expect("remove");
            // Not a Service port any more: the address stays (its SYN vanishes out of the veth).
            let error = TcpStream::connect_timeout(&svc, Duration::from_millis(300))
                .expect_err("not translated");
            assert_eq!(error.kind(), ErrorKind::TimedOut, "{error}");
        },
    );
}

#[test]
fn dropping_the_programs_detaches_and_unloads_them() {
    isolated::run(
        "dropping_the_programs_detaches_and_unloads_them",
        unavailable,
        || {
            node();
            let svc = at(CLUSTER_IP, 80);
            let a = at(A, 8080);
            let Attached {
                mut cgroup,
                programs,
                mut lb,
            } = attach();
            lb.set(service(CLUSTER_IP, 80, Protocol::Tcp), &[a])
                .expect("set");
            cgroup.enter().expect("enter cgroup");
            assert_eq!(tcp_answer(svc).0, a.to_string());
            let ids = programs.program_ids();
            // Eight sock_addr programs, and the two socket iterators where they load.
            let iterators = if programs.destroy_unavailable().is_none() {
                2
            } else {
                0
            };
            assert_eq!(ids.len(), 8 + iterators, "{ids:?}");
            assert!(ids.iter().all(|id| loaded(*id)), "{ids:?}");
            drop(programs);
            drop(lb);
            // The same cgroup, the same Service address: nftables' rule serves it again.
            assert_eq!(tcp_answer(svc).0, "10.244.1.4:8080");
            let left: Vec<u32> = ids.into_iter().filter(|id| loaded(*id)).collect();
            assert!(left.is_empty(), "still loaded: {left:?}");
        },
    );
}

#[test]
fn ipv6_tcp_and_udp_reach_the_endpoint_and_show_the_service() {
    isolated::run(
        "ipv6_tcp_and_udp_reach_the_endpoint_and_show_the_service",
        unavailable,
        || {
            node();
            sh("ip addr add fd00:10:244:1::3/128 dev lo nodad \
                && ip route add fd00:96::/112 dev kpv0");
            let (tcp, udp) = (at(A6, 8080), at(A6, 5353));
            tcp_server(tcp);
            udp_server(udp);
            let mut node = attach();
            node.lb
                .set(service(CLUSTER_IP6, 80, Protocol::Tcp), &[tcp])
                .expect("set");
            node.lb
                .set(service(CLUSTER_IP6, 53, Protocol::Udp), &[udp])
                .expect("set");
            node.lb
                .set(service(EMPTY_IP6, 80, Protocol::Tcp), &[])
                .expect("set");
            node.cgroup.enter().expect("enter cgroup");

            let svc = at(CLUSTER_IP6, 80);
            let (who, stream) = tcp_answer(svc);
            assert_eq!(who, tcp.to_string(), "translated by connect6");
            assert_eq!(stream.peer_addr().expect("peer"), svc, "getpeername6");
            let socket = UdpSocket::bind("[::]:0").expect("bind");
            socket.set_read_timeout(Some(WAIT)).expect("timeout");
            let svc = at(CLUSTER_IP6, 53);
            socket.send_to(b"q", svc).expect("send_to");
            let mut buf = [0u8; 64];
            let (len, from) = socket.recv_from(&mut buf).expect("reply");
            assert_eq!(&buf[..len], udp.to_string().as_bytes(), "sendmsg6");
            assert_eq!(from, svc, "recvmsg6");
            let error = TcpStream::connect_timeout(&at(EMPTY_IP6, 80), WAIT).expect_err("refused");
            assert_eq!(error.kind(), ErrorKind::ConnectionRefused, "{error}");
        },
    );
}

#[test]
fn a_proxy_state_is_served_as_the_shared_plan_decides() {
    use kp_core::testutil::{cluster_ip_port, endpoint, node_with, port_name, state_on};
    isolated::run(
        "a_proxy_state_is_served_as_the_shared_plan_decides",
        unavailable,
        || {
            node();
            // internalTrafficPolicy Local: a is on this node, b on another.
            let name = port_name("ns", "local", "http", Protocol::Tcp);
            let mut local = cluster_ip_port(name, "10.96.0.12", 80);
            local.internal_policy_local = true;
            let backends = vec![
                endpoint("10.244.1.3", 8080, true),
                endpoint("10.244.1.4", 8080, false),
            ];
            let empty = cluster_ip_port(
                port_name("ns", "empty", "http", Protocol::Tcp),
                "10.96.0.13",
                80,
            );
            let state = state_on(
                node_with(&["192.168.0.2"]),
                vec![(local, backends), (empty, vec![])],
            );
            let mut node = attach();
            let report = node.lb.sync(&kp_socklb::desired(&state));
            assert!(report.failed.is_empty(), "{:?}", report.failed);
            node.cgroup.enter().expect("enter cgroup");
            for _ in 0..16 {
                assert_eq!(
                    tcp_answer(at(Ipv4Addr::new(10, 96, 0, 12), 80)).0,
                    "10.244.1.3:8080"
                );
            }
            let refused = TcpStream::connect_timeout(&at(Ipv4Addr::new(10, 96, 0, 13), 80), WAIT);
            let error = refused.expect_err("no endpoints");
            assert_eq!(error.kind(), ErrorKind::ConnectionRefused, "{error}");
        },
    );
}

/// In a fresh network namespace (this thread's, from [`isolated::on_thread`]): endpoints a
/// and b on its loopback, as in [`node`], so a client here reaches them.
fn client_namespace() {
    sh("ip link set lo up && ip addr add 10.244.1.3/32 dev lo && ip addr add 10.244.1.4/32 dev lo");
    for endpoint in [A, B] {
        tcp_server(at(endpoint, 8080));
    }
}

/// The endpoint a client keeps answering from: `n` connections, asserted to agree.
fn pinned_endpoint(svc: SocketAddr, n: usize) -> String {
    let first = tcp_answer(svc).0;
    for _ in 1..n {
        assert_eq!(tcp_answer(svc).0, first, "pinned");
    }
    first
}

#[test]
fn client_ip_affinity_pins_each_network_namespace() {
    isolated::run(
        "client_ip_affinity_pins_each_network_namespace",
        unavailable,
        || {
            node();
            sh("ip addr add 10.244.1.5/32 dev lo");
            tcp_server(at(C, 8080));
            // EMPTY_IP is routed out of the veth: only a translated SYN is answered.
            let svc = at(EMPTY_IP, 80);
            let key = service(EMPTY_IP, 80, Protocol::Tcp);
            let (a, b, c) = (at(A, 8080), at(B, 8080), at(C, 8080));
            let mut node = attach();
            node.lb.set_target(key, &[a, b], 60_000).expect("set");
            node.cgroup.enter().expect("enter cgroup");
            // 32 connections to one endpoint: without affinity, probability 2^-31.
            let mine = pinned_endpoint(svc, 32);

            // Other namespaces pick for themselves (each the other endpoint with probability
            // 1/2: 20 all pinned alike, 2^-20), and leave this one's pin alone.
            let elsewhere = (0..20).find_map(|_| {
                isolated::on_thread(|| {
                    client_namespace();
                    let theirs = pinned_endpoint(svc, 8);
                    (theirs != mine).then_some(theirs)
                })
            });
            assert!(elsewhere.is_some(), "every namespace got {mine}");
            assert_eq!(pinned_endpoint(svc, 8), mine, "still pinned here");

            // Expiry: 300 ms after its last connect a client picks anew (the other endpoint
            // with probability 1/2 each time: never in 20 rounds, 2^-20).
            node.lb.set_target(key, &[a, b], 300).expect("set");
            let mut current = mine;
            let moved = (0..20).any(|_| {
                std::thread::sleep(Duration::from_millis(400));
                let now = tcp_answer(svc).0;
                std::mem::replace(&mut current, now) != current
            });
            assert!(moved, "never re-picked after expiry: {current}");

            // An endpoint leaving unpins its clients; one staying keeps them.
            node.lb.set_target(key, &[a, b, c], 60_000).expect("set");
            let pinned = pinned_endpoint(svc, 4);
            let rest: Vec<SocketAddr> = [a, b, c]
                .into_iter()
                .filter(|e| e.to_string() != pinned)
                .collect();
            node.lb.set_target(key, &rest, 60_000).expect("set");
            let repinned = pinned_endpoint(svc, 16);
            assert_ne!(repinned, pinned, "unpinned from the gone endpoint");
            node.lb.set_target(key, &[a, b, c], 60_000).expect("set");
            assert_eq!(pinned_endpoint(svc, 16), repinned, "its endpoint stayed");
        },
    );
}

#[test]
fn client_ip_affinity_over_ipv6_pins_and_unpins() {
    isolated::run(
        "client_ip_affinity_over_ipv6_pins_and_unpins",
        unavailable,
        || {
            node();
            sh("ip addr add fd00:10:244:1::3/128 dev lo nodad \
                && ip addr add fd00:10:244:1::4/128 dev lo nodad \
                && ip route add fd00:96::/112 dev kpv0");
            let a = at(A6, 8080);
            let b = at(Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 4), 8080);
            tcp_server(a);
            tcp_server(b);
            let sticky = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x12);
            let (svc, key) = (at(sticky, 80), service(sticky, 80, Protocol::Tcp));
            let mut node = attach();
            node.lb.set_target(key, &[a, b], 60_000).expect("set");
            node.cgroup.enter().expect("enter cgroup");
            let pinned = pinned_endpoint(svc, 32);
            let other = if pinned == a.to_string() { b } else { a };
            node.lb.set_target(key, &[other], 60_000).expect("set");
            assert_eq!(tcp_answer(svc).0, other.to_string(), "unpinned");
            node.lb.set_target(key, &[a, b], 60_000).expect("set");
            assert_eq!(pinned_endpoint(svc, 16), other.to_string(), "pinned anew");
        },
    );
}

/// A private bpffs (mounted by [`pin::prepare`] under a temporary directory), unmounted on
/// drop, which releases whatever is still pinned there.
struct Bpffs {
    root: tempfile::TempDir,
}

impl Bpffs {
    fn mount() -> Self {
        let root = tempfile::tempdir().expect("tempdir");
        let bpffs = Self { root };
        assert!(
            pin::prepare(&bpffs.pins()).expect("mount bpffs"),
            "mounted one"
        );
        bpffs
    }

    /// The pins' directory on it.
    fn pins(&self) -> std::path::PathBuf {
        pin::pin_dir(Some(self.root.path()))
    }
}

impl Drop for Bpffs {
    fn drop(&mut self) {
        let base = self.root.path().join("bpf");
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(base)
            .status();
    }
}

/// Waits (up to [`WAIT`]) for connections to `svc` to reach `endpoint`: the kernel releases
/// a link whose last pin went from a work queue, a moment later.
fn answered_soon_by(svc: SocketAddr, endpoint: &str) {
    let start = std::time::Instant::now();
    let mut last = tcp_answer(svc).0;
    while last != endpoint && start.elapsed() < WAIT {
        std::thread::sleep(Duration::from_millis(20));
        last = tcp_answer(svc).0;
    }
    assert_eq!(last, endpoint, "not reached within {WAIT:?}");
}

#[test]
fn pinned_programs_outlive_their_loader_are_adopted_and_restored() {
    isolated::run(
        "pinned_programs_outlive_their_loader_are_adopted_and_restored",
        unavailable,
        || {
            node();
            let bpffs = Bpffs::mount();
            let dir = bpffs.pins();
            let svc = at(CLUSTER_IP, 80);
            let (a, key) = (at(A, 8080), service(CLUSTER_IP, 80, Protocol::Tcp));
            let mut cgroup = TestCgroup::create(CGROUP_PREFIX).expect("test cgroup");
            let (mut programs, maps) = SocketPrograms::load_pinned(&dir).expect("load");
            programs.attach(cgroup.path()).expect("attach");
            let mut lb = Balancer::new(maps);
            lb.set(key, &[a]).expect("set");
            cgroup.enter().expect("enter cgroup");
            assert_eq!(tcp_answer(svc).0, a.to_string());
            // The loader goes, as a killed proxy: the pins keep translating.
            drop((programs, lb));
            assert_eq!(tcp_answer(svc).0, a.to_string(), "still attached");

            // A new loader adopts the maps as they are and replaces the links.
            let (mut programs, maps) = SocketPrograms::load_pinned(&dir).expect("load");
            let (held, top) = maps.read_back();
            assert_eq!(held.len(), 1, "{held:?}");
            assert_eq!((held[0].key, &held[0].slots[..]), (key, &[Some(a)][..]));
            let mut lb = Balancer::new(maps);
            lb.adopt(held, top);
            assert_eq!(
                lb.set(key, &[a]).expect("set"),
                0,
                "adopted: nothing to write"
            );
            programs.attach(cgroup.path()).expect("attach");
            assert!(programs.verify().is_empty(), "{:?}", programs.verify());
            assert_eq!(tcp_answer(svc).0, a.to_string());

            // Someone removes the link pins (the programs detach) and a map's pin.
            for (name, _) in PROGRAMS {
                std::fs::remove_file(pin::link_pin(&dir, name)).expect("unpin");
            }
            std::fs::remove_file(pin::map_pin(&dir, "kp_services")).expect("unpin");
            answered_soon_by(svc, "10.244.1.4:8080");
            let missing = programs.verify();
            assert_eq!(missing.len(), PROGRAMS.len() + 1, "{missing:?}");
            assert!(
                missing.contains(&MissingPin::Map("kp_services")),
                "{missing:?}"
            );
            programs.repair(&missing).expect("repair");
            assert!(programs.verify().is_empty(), "{:?}", programs.verify());
            assert_eq!(tcp_answer(svc).0, a.to_string(), "translated again");

            // Someone detaches the links and leaves their pins (`bpftool link detach`).
            for (name, _) in PROGRAMS {
                kp_testbed::cgroup::detach_link(&pin::link_pin(&dir, name)).expect("detach");
            }
            answered_soon_by(svc, "10.244.1.4:8080");
            let detached: Vec<MissingPin> =
                PROGRAMS.map(|(name, _)| MissingPin::Detached(name)).into();
            assert_eq!(programs.verify(), detached);
            programs.repair(&detached).expect("repair");
            assert!(programs.verify().is_empty(), "{:?}", programs.verify());
            assert_eq!(tcp_answer(svc).0, a.to_string(), "attached again");

            // Removing the pins detaches them for good once the loader goes.
            assert_eq!(pin::remove(&dir).expect("remove"), 16);
            drop((programs, lb));
            answered_soon_by(svc, "10.244.1.4:8080");
        },
    );
}

fn loaded(id: u32) -> bool {
    aya::programs::loaded_programs()
        .flatten()
        .any(|program| program.id() == id)
}

/// Set in the child of [`loading_without_capabilities_says_not_permitted`].
const NO_CAPS_CHILD: &str = "KP_SOCKLB_NO_CAPS_CHILD";

#[test]
fn loading_without_capabilities_says_not_permitted() {
    if std::env::var_os(NO_CAPS_CHILD).is_some() {
        let error = SocketPrograms::load().expect_err("no capabilities");
        assert!(
            matches!(
                error,
                LoadError::Unavailable(Unavailable::NotPermitted { .. })
            ),
            "{error:?}"
        );
        println!("error: {error}");
        return;
    }
    let test = "loading_without_capabilities_says_not_permitted";
    if isolated::skip(test, isolated::missing(&["setpriv"], &["true"])) {
        return;
    }
    let exe = std::env::current_exe().expect("test binary");
    // Root without any capability: the bpf() syscall must say EPERM.
    let output = std::process::Command::new("setpriv")
        .args(["--bounding-set=-all", "--inh-caps=-all", "--"])
        .arg(exe)
        .args([test, "--exact", "--nocapture"])
        .env(NO_CAPS_CHILD, "1")
        .output()
        .expect("run setpriv");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("1 passed"), "{stdout}");
    assert!(
        stdout.contains("not permitted to load BPF programs"),
        "{stdout}"
    );
}

#[test]
fn attaching_outside_cgroup_v2_says_so() {
    let test = "attaching_outside_cgroup_v2_says_so";
    if isolated::skip(test, unavailable()) {
        return;
    }
    let (mut programs, _maps) = SocketPrograms::load().expect("load");
    let error = programs
        .attach(&std::env::temp_dir())
        .expect_err("not cgroup v2");
    assert!(
        error.to_string().contains("is not a cgroup v2 directory"),
        "{error}"
    );
    assert_eq!(programs.attached(), None);
}

/// Why this kernel cannot destroy sockets (no kfunc, no iterators), besides [`unavailable`].
fn destroy_unavailable() -> Option<String> {
    unavailable().or_else(|| match SocketPrograms::load() {
        Ok((programs, _)) => programs.destroy_unavailable().map(|why| why.to_string()),
        Err(error) => Some(error.to_string()),
    })
}

/// Greets each connection with its own address and keeps it open until the client closes.
fn tcp_holding_server(addr: SocketAddr) {
    let listener = TcpListener::bind(addr).expect("bind endpoint");
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut stream = stream;
                let _ = std::io::Write::write_all(&mut stream, format!("{addr}\n").as_bytes());
                let _ = std::io::copy(&mut stream, &mut std::io::sink());
            });
        }
    });
}

#[test]
fn sockets_of_a_removed_endpoint_are_destroyed() {
    isolated::run(
        "sockets_of_a_removed_endpoint_are_destroyed",
        destroy_unavailable,
        || {
            node();
            let (a, b) = (at(A, 8081), at(B, 8081));
            for endpoint in [a, b] {
                tcp_holding_server(endpoint);
            }
            let (dns, dns_a, dns_b) = (at(CLUSTER_IP, 53), at(A, 5353), at(B, 5353));
            let (web, other) = (at(CLUSTER_IP, 81), at(EMPTY_IP, 81));
            let dns_key = service(CLUSTER_IP, 53, Protocol::Udp);
            let (web_key, other_key) = (
                service(CLUSTER_IP, 81, Protocol::Tcp),
                service(EMPTY_IP, 81, Protocol::Tcp),
            );
            let mut node = attach();
            node.lb.set(dns_key, &[dns_a]).expect("set");
            node.lb.set(web_key, &[a]).expect("set");
            // Another Service on the same endpoint: its connection must survive.
            node.lb.set(other_key, &[a]).expect("set");
            node.cgroup.enter().expect("enter cgroup");

            let udp = UdpSocket::bind("0.0.0.0:0").expect("bind");
            udp.set_read_timeout(Some(WAIT)).expect("timeout");
            udp.connect(dns).expect("connect");
            let mut buf = [0u8; 64];
            udp.send(b"q").expect("send");
            let len = udp.recv(&mut buf).expect("reply");
            assert_eq!(&buf[..len], dns_a.to_string().as_bytes());
            let (who, mut tcp) = tcp_answer(web);
            assert_eq!(who, a.to_string());
            let (who, mut kept) = tcp_answer(other);
            assert_eq!(who, a.to_string());
            // A socket outside the programs' reach to the same endpoint, untranslated.
            let (who, direct) = tcp_answer(a);
            assert_eq!(who, a.to_string());

            node.lb.set(dns_key, &[dns_b]).expect("set");
            node.lb.set(web_key, &[b]).expect("set");
            let removed = node.lb.take_removed();
            assert_eq!(removed, [(dns_key, dns_a), (web_key, a)]);
            let report = node.programs.destroy_sockets(&removed).expect("destroy");
            assert_eq!(report.destroyed, 2, "{report:?}");
            assert!(report.namespaces >= 1, "{report:?}");

            destroyed_and_reconnected(&mut tcp, &udp, dns, dns_b);
            let (who, _) = tcp_answer(web);
            assert_eq!(
                who,
                b.to_string(),
                "new connections go to the remaining one"
            );

            // The other Service's connection and the untranslated one are untouched.
            for mut alive in [kept.try_clone().expect("clone"), direct] {
                alive
                    .set_read_timeout(Some(Duration::from_millis(200)))
                    .expect("t");
                std::io::Write::write_all(&mut alive, b"still here").expect("write");
                let error = std::io::Read::read(&mut alive, &mut buf).expect_err("no data");
                assert!(
                    matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
                    "{error}"
                );
            }
            let _ = std::io::Write::write_all(&mut kept, b"bye");
        },
    );
}

/// After the destroy pass: the TCP connection is reset (the application reads
/// ECONNABORTED); the connected UDP socket reads ECONNABORTED and is disconnected, so the
/// application reconnects to `dns` and is translated to the remaining endpoint `dns_b`.
fn destroyed_and_reconnected(
    tcp: &mut TcpStream,
    udp: &UdpSocket,
    dns: SocketAddr,
    dns_b: SocketAddr,
) {
    let mut buf = [0u8; 64];
    let error = std::io::Read::read(tcp, &mut buf).expect_err("destroyed");
    assert_eq!(error.kind(), ErrorKind::ConnectionAborted, "{error}");
    let error = udp.recv(&mut buf).expect_err("destroyed");
    assert_eq!(error.kind(), ErrorKind::ConnectionAborted, "{error}");
    assert!(udp.send(b"q").is_err(), "no longer connected");
    udp.connect(dns).expect("reconnect");
    udp.send(b"q").expect("send");
    let len = udp.recv(&mut buf).expect("reply");
    assert_eq!(&buf[..len], dns_b.to_string().as_bytes());
    assert_eq!(udp.peer_addr().expect("peer"), dns);
}

/// A dual-stack (`AF_INET6`) socket reaching an IPv4 Service as `::ffff:a.b.c.d` is
/// translated by the IPv4 maps; the destroy pass must find it by its IPv4 peer too.
#[test]
fn mapped_ipv6_sockets_of_a_removed_endpoint_are_destroyed() {
    isolated::run(
        "mapped_ipv6_sockets_of_a_removed_endpoint_are_destroyed",
        destroy_unavailable,
        || {
            node();
            let (a, b) = (at(A, 8081), at(B, 8081));
            for endpoint in [a, b] {
                tcp_holding_server(endpoint);
            }
            let (dns_a, dns_b) = (at(A, 5353), at(B, 5353));
            let mapped = |port| at(CLUSTER_IP.to_ipv6_mapped(), port);
            let (dns, web) = (mapped(53), mapped(81));
            let dns_key = service(CLUSTER_IP, 53, Protocol::Udp);
            let web_key = service(CLUSTER_IP, 81, Protocol::Tcp);
            let mut node = attach();
            node.lb.set(dns_key, &[dns_a]).expect("set");
            node.lb.set(web_key, &[a]).expect("set");
            node.cgroup.enter().expect("enter cgroup");

            // `[::]` without IPV6_V6ONLY: a dual-stack socket.
            let udp = UdpSocket::bind("[::]:0").expect("bind");
            udp.set_read_timeout(Some(WAIT)).expect("timeout");
            udp.connect(dns).expect("connect");
            let mut buf = [0u8; 64];
            udp.send(b"q").expect("send");
            let len = udp.recv(&mut buf).expect("reply");
            assert_eq!(&buf[..len], dns_a.to_string().as_bytes());
            assert_eq!(udp.peer_addr().expect("peer"), dns);
            let (who, mut tcp) = tcp_answer(web);
            assert_eq!(who, a.to_string());
            assert_eq!(tcp.peer_addr().expect("peer"), web);

            node.lb.set(dns_key, &[dns_b]).expect("set");
            node.lb.set(web_key, &[b]).expect("set");
            let removed = node.lb.take_removed();
            let report = node.programs.destroy_sockets(&removed).expect("destroy");
            assert_eq!(report.destroyed, 2, "both mapped sockets: {report:?}");

            destroyed_and_reconnected(&mut tcp, &udp, dns, dns_b);
        },
    );
}
