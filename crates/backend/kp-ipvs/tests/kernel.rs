//! IPVS in a real kernel: one boot of the test VM (tools/kp-vm, Debian's kernel) runs every
//! `#[ignore]`d test below; the host test fails when the VM cannot start or any of them fails.
//! Guest tests share the VM's IPVS table, so they run one at a time and each starts with a
//! flush. Results are cross-checked with the real `ipvsadm`.

use std::net::IpAddr;
use std::process::Command;

use kp_ipvs::{
    FLAG_PERSISTENT, FakeIpvs, Ipvs, IpvsError, NetlinkIpvs, Protocol, RealServer, Scheduler,
    ServiceKey, Timeouts, VirtualServer,
};

/// Guest tests in this file (the host test checks that this many passed).
const GUEST_TESTS: usize = 8;

#[test]
fn ipvs_suite_in_the_vm() {
    let out = kp_vm::Vm::from_env()
        .program("ipvsadm")
        .run_current_exe(&["kernel::", "--ignored", "--test-threads=1"])
        .unwrap_or_else(|e| panic!("the IPVS VM did not run: {e}"));
    out.assert_tests_passed(GUEST_TESTS);
}

fn timeouts(tcp: u32, tcp_fin: u32, udp: u32) -> Timeouts {
    Timeouts { tcp, tcp_fin, udp }
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test address")
}

fn key(addr: &str, protocol: Protocol, port: u16) -> ServiceKey {
    ServiceKey {
        address: ip(addr),
        protocol,
        port,
    }
}

/// A handle on the guest kernel's IPVS with an empty table.
fn ipvs() -> NetlinkIpvs {
    assert!(kp_vm::in_guest(), "this test needs the VM's kernel");
    let mut ipvs = NetlinkIpvs::open().expect("IPVS family resolves in the VM");
    ipvs.flush().expect("flush");
    ipvs
}

/// `ipvsadm ARGS` output, runs of spaces squeezed to one.
fn ipvsadm(args: &[&str]) -> String {
    let out = Command::new("ipvsadm")
        .args(args)
        .output()
        .expect("ipvsadm runs");
    assert!(out.status.success(), "ipvsadm {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
#[ignore = "runs inside the IPVS VM (ipvs_suite_in_the_vm)"]
fn resolves_the_family_and_lists_nothing_after_a_flush() {
    let mut ipvs = ipvs();
    assert_ne!(ipvs.family_id(), 0);
    assert_eq!(ipvs.services().expect("list"), Vec::new());
}

#[test]
#[ignore = "runs inside the IPVS VM (ipvs_suite_in_the_vm)"]
fn every_scheduler_creates_a_virtual_server() {
    let mut ipvs = ipvs();
    let mut wanted = Vec::new();
    for (i, s) in Scheduler::ALL.into_iter().enumerate() {
        let port = 8000 + u16::try_from(i).expect("few");
        let vs = VirtualServer::new(key("10.96.0.1", Protocol::Tcp, port), s, None);
        ipvs.add_service(&vs).unwrap_or_else(|e| panic!("{s}: {e}"));
        wanted.push(vs);
    }
    let mut listed = ipvs.services().expect("list");
    listed.sort_by_key(|v| v.key);
    assert_eq!(listed, wanted);
    let text = ipvsadm(&["-Ln"]);
    assert!(text.contains("TCP 10.96.0.1:8000 rr"), "{text}");
    assert!(text.contains("TCP 10.96.0.1:8010 mh (mh-port)"), "{text}");
}

#[test]
#[ignore = "runs inside the IPVS VM (ipvs_suite_in_the_vm)"]
fn services_of_both_families_and_all_protocols_are_edited_in_place() {
    let mut ipvs = ipvs();
    let services = [
        VirtualServer::new(key("10.96.0.10", Protocol::Udp, 53), Scheduler::Rr, None),
        VirtualServer::new(key("10.96.0.11", Protocol::Sctp, 3868), Scheduler::Rr, None),
        VirtualServer::new(
            key("2001:db8::10", Protocol::Tcp, 443),
            Scheduler::Wlc,
            Some(10800),
        ),
    ];
    for vs in &services {
        ipvs.add_service(vs)
            .unwrap_or_else(|e| panic!("{}: {e}", vs.key));
    }
    let mut listed = ipvs.services().expect("list");
    listed.sort_by_key(|v| v.key);
    assert_eq!(listed, services);
    let text = ipvsadm(&["-Ln"]);
    assert!(
        text.contains("TCP [2001:db8::10]:443 wlc persistent 10800"),
        "{text}"
    );
    assert!(text.contains("SCTP 10.96.0.11:3868 rr"), "{text}");

    // sessionAffinity switched on for the UDP service, and its scheduler changed.
    let edited = VirtualServer::new(services[0].key, Scheduler::Sh, Some(60));
    ipvs.update_service(&edited).expect("edit in place");
    let listed = ipvs.services().expect("list");
    let now = listed
        .iter()
        .find(|v| v.key == edited.key)
        .expect("still there");
    assert_eq!(now, &edited);
    assert_eq!(now.flags & FLAG_PERSISTENT, FLAG_PERSISTENT);

    ipvs.delete_service(&services[1].key).expect("delete");
    assert_eq!(ipvs.services().expect("list").len(), 2);
}

#[test]
#[ignore = "runs inside the IPVS VM (ipvs_suite_in_the_vm)"]
fn destinations_are_added_reweighted_and_removed() {
    let mut ipvs = ipvs();
    let svc = key("10.96.0.20", Protocol::Tcp, 80);
    ipvs.add_service(&VirtualServer::new(svc, Scheduler::Rr, None))
        .expect("service");
    let a = RealServer::new(ip("10.244.1.5"), 8080, 1);
    let b = RealServer::new(ip("10.244.2.6"), 8080, 1);
    ipvs.add_destination(&svc, &a).expect("a");
    ipvs.add_destination(&svc, &b).expect("b");
    let mut listed: Vec<RealServer> = ipvs
        .destinations(&svc)
        .expect("list")
        .into_iter()
        .map(|d| d.server)
        .collect();
    listed.sort_by_key(|d| d.address);
    assert_eq!(listed, vec![a.clone(), b.clone()]);
    let text = ipvsadm(&["-Ln", "-t", "10.96.0.20:80"]);
    assert!(text.contains("-> 10.244.1.5:8080 Masq 1 0 0"), "{text}");

    // A terminating endpoint drains: weight 0, still present.
    let draining = RealServer::new(b.address, b.port, 0);
    ipvs.update_destination(&svc, &draining).expect("reweight");
    let listed = ipvs.destinations(&svc).expect("list");
    let got = listed
        .iter()
        .find(|d| d.server.address == b.address)
        .expect("b stays");
    assert_eq!(got.server.weight, 0);

    ipvs.delete_destination(&svc, &a).expect("delete a");
    let listed = ipvs.destinations(&svc).expect("list");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].server, draining);

    // IPv6 endpoints behind an IPv6 service.
    let svc6 = key("fd00:10:96::20", Protocol::Udp, 53);
    ipvs.add_service(&VirtualServer::new(svc6, Scheduler::Rr, None))
        .expect("v6 service");
    let c = RealServer::new(ip("fd00:10:244::7"), 5353, 1);
    ipvs.add_destination(&svc6, &c).expect("v6 dest");
    assert_eq!(ipvs.destinations(&svc6).expect("list")[0].server, c);
}

#[test]
#[ignore = "runs inside the IPVS VM (ipvs_suite_in_the_vm)"]
fn timeouts_are_set_and_read_back() {
    let mut ipvs = ipvs();
    let before = ipvs.timeouts().expect("get");
    assert_eq!(before.tcp, 900, "kernel default");
    ipvs.set_timeouts(&timeouts(1000, 60, 200)).expect("set");
    assert_eq!(ipvs.timeouts().expect("get"), timeouts(1000, 60, 200));
    // A zero leaves that value alone.
    ipvs.set_timeouts(&timeouts(0, 0, 250)).expect("set");
    assert_eq!(ipvs.timeouts().expect("get"), timeouts(1000, 60, 250));
    assert!(ipvsadm(&["-L", "--timeout"]).contains("1000 60 250"));
    ipvs.set_timeouts(&before).expect("restore");
}

#[test]
#[ignore = "runs inside the IPVS VM (ipvs_suite_in_the_vm)"]
fn kernel_errors_come_back_with_their_errno() {
    let mut ipvs = ipvs();
    let vs = VirtualServer::new(key("10.96.0.30", Protocol::Tcp, 80), Scheduler::Rr, None);
    ipvs.add_service(&vs).expect("first add");
    let err = ipvs.add_service(&vs).expect_err("duplicate");
    assert_eq!(err.errno(), Some(17), "EEXIST: {err}");
    assert!(
        err.to_string().contains("add service 10.96.0.30:80/TCP"),
        "{err}"
    );
    let missing = key("10.96.0.31", Protocol::Tcp, 80);
    let err = ipvs.delete_service(&missing).expect_err("missing");
    assert_eq!(err.errno(), Some(3), "ESRCH: {err}");
    let mut bad = vs.clone();
    bad.key.port = 81;
    bad.scheduler = "nonexistent".into();
    assert!(matches!(
        ipvs.add_service(&bad),
        Err(IpvsError::Kernel { .. })
    ));
    // The socket is still in step after errors.
    assert_eq!(ipvs.services().expect("list"), vec![vs]);
}

#[test]
#[ignore = "runs inside the IPVS VM (ipvs_suite_in_the_vm)"]
fn flush_removes_every_virtual_server() {
    let mut ipvs = ipvs();
    for port in 1..=50 {
        ipvs.add_service(&VirtualServer::new(
            key("10.96.1.1", Protocol::Tcp, port),
            Scheduler::Rr,
            None,
        ))
        .expect("add");
    }
    // 50 services do not fit one netlink datagram: the dump spans several.
    assert_eq!(ipvs.services().expect("list").len(), 50);
    ipvs.flush().expect("flush");
    assert!(ipvs.services().expect("list").is_empty());
    assert!(!ipvsadm(&["-Ln"]).contains("10.96.1.1"));
}

/// What backends rely on, checked against the kernel (in the VM) and against [`FakeIpvs`]
/// (on the host), so tests that use the fake test against the kernel's behaviour.
fn contract(ipvs: &mut impl Ipvs) {
    let svc = key("10.96.0.40", Protocol::Tcp, 80);
    let vs = VirtualServer::new(svc, Scheduler::Rr, None);
    ipvs.add_service(&vs).expect("add");
    assert_eq!(
        ipvs.add_service(&vs).expect_err("duplicate").errno(),
        Some(17)
    );
    let other = key("10.96.0.41", Protocol::Tcp, 80);
    assert_eq!(
        ipvs.delete_service(&other).expect_err("missing").errno(),
        Some(3)
    );
    let mut unknown = VirtualServer::new(other, Scheduler::Rr, None);
    unknown.scheduler = "nonexistent".into();
    assert!(ipvs.add_service(&unknown).is_err());
    assert_eq!(
        ipvs.update_service(&VirtualServer::new(other, Scheduler::Rr, None))
            .expect_err("edit of a missing service")
            .errno(),
        Some(3)
    );

    let a = RealServer::new(ip("10.244.1.5"), 8080, 1);
    ipvs.add_destination(&svc, &a).expect("add dest");
    assert_eq!(
        ipvs.add_destination(&svc, &a).expect_err("dup").errno(),
        Some(17)
    );
    let b = RealServer::new(ip("10.244.1.6"), 8080, 1);
    assert_eq!(
        ipvs.delete_destination(&svc, &b)
            .expect_err("missing")
            .errno(),
        Some(2)
    );
    assert_eq!(
        ipvs.update_destination(&svc, &b)
            .expect_err("missing")
            .errno(),
        Some(2)
    );
    assert_eq!(
        ipvs.add_destination(&other, &b)
            .expect_err("no service")
            .errno(),
        Some(3)
    );
    ipvs.update_destination(&svc, &RealServer::new(a.address, a.port, 0))
        .expect("reweight");
    let listed = ipvs.destinations(&svc).expect("list");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].server.weight, 0);
    assert_eq!(
        (listed[0].active_connections, listed[0].inactive_connections),
        (0, 0)
    );

    let t = ipvs.timeouts().expect("timeouts");
    assert_eq!(t, timeouts(900, 120, 300), "kernel defaults");
    ipvs.set_timeouts(&timeouts(0, 30, 0)).expect("set");
    assert_eq!(ipvs.timeouts().expect("get"), timeouts(900, 30, 300));
    ipvs.set_timeouts(&t).expect("restore");

    ipvs.delete_service(&svc).expect("delete");
    // The kernel's dump of a missing service's destinations is empty, not an error.
    assert!(
        ipvs.destinations(&svc)
            .expect("list of a missing service")
            .is_empty()
    );
    ipvs.flush().expect("flush");
    assert!(ipvs.services().expect("list").is_empty());
}

#[test]
fn the_fake_behaves_like_the_kernel() {
    contract(&mut FakeIpvs::new());
}

#[test]
#[ignore = "runs inside the IPVS VM (ipvs_suite_in_the_vm)"]
fn the_kernel_meets_the_contract() {
    contract(&mut ipvs());
}
