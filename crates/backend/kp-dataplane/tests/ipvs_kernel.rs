//! ipvs mode against a real kernel with IPVS: one boot of the test VM (tools/kp-vm, Debian's
//! kernel) runs the `#[ignore]`d tests below with the real IPVS netlink family, rtnetlink,
//! `ipset` and `iptables`; the host test fails if the VM cannot start or any of them fails.
//! Guest tests share the VM's kernel, so they run one at a time and each cleans up first.

use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;

use kp_core::backend::{Backend, SyncKind};
use kp_core::model::{IpFamily, Protocol, SessionAffinity};
use kp_core::tracker::ProxyState;
use kp_dataplane::exec::{ExecRunner, IptablesVariant, Tools};
use kp_dataplane::ipvs::{ExecIpset, IpvsBackend, IpvsBackendConfig, RtLinks};
use kp_dataplane::sysctls::FsSysctl;
use kp_dataplane::testutil::*;
use kp_ipvs::{Ipvs, NetlinkIpvs, Scheduler, Timeouts};
use kp_rules::ipvs::IpvsConfig;

const GUEST_TESTS: usize = 2;

#[test]
fn ipvs_backend_suite_in_the_vm() {
    let out = kp_vm::Vm::from_env()
        .iptables()
        .program("ipvsadm")
        .program("ipset")
        .run_current_exe(&["ipvs_kernel::", "--ignored", "--test-threads=1"])
        .unwrap_or_else(|e| panic!("the IPVS VM did not run: {e}"));
    out.assert_tests_passed(GUEST_TESTS);
}

type Real = IpvsBackend<NetlinkIpvs>;

fn backend(scheduler: Scheduler) -> Real {
    assert!(kp_vm::in_guest(), "this test needs the VM's kernel");
    IpvsBackend::with_parts(
        IpvsBackendConfig {
            families: vec![IpFamily::V4, IpFamily::V6],
            plan: IpvsConfig {
                scheduler,
                node_ips: vec![ip("192.168.0.2")],
                masquerade_bit: 14,
                drop_invalid: true,
                random_fully: true,
                ..IpvsConfig::default()
            },
            timeouts: Timeouts {
                tcp: 1800,
                tcp_fin: 0,
                udp: 0,
            },
            strict_arp: true,
            exclude_cidrs: Vec::new(),
            node_addresses: Vec::new(),
        },
        NetlinkIpvs::open().expect("IPVS in the VM"),
        RtLinks::new(),
        ExecRunner::new(Tools::new(IptablesVariant::System)),
        ExecIpset,
        Box::new(FsSysctl::host()),
    )
}

fn sh(cmd: &str) -> String {
    let out = Command::new("sh").args(["-c", cmd]).output().expect("sh");
    assert!(out.status.success(), "{cmd}: {out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect::<Vec<_>>()
        .join("\n")
}

/// One runtime for a whole test: the rtnetlink connection lives on the first one used.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

fn sync(
    rt: &tokio::runtime::Runtime,
    backend: &mut Real,
    state: &ProxyState,
) -> kp_core::backend::SyncReport {
    let changed = BTreeSet::new();
    rt.block_on(backend.sync(&request(state, SyncKind::Full, &changed, false)))
        .expect("sync")
}

fn web_state() -> ProxyState {
    let mut web = service("ns", "web", Protocol::Tcp, "10.96.0.1", 80);
    web.node_port = Some(30080);
    let dns = service("kube-system", "dns", Protocol::Udp, "10.96.0.10", 53);
    let v6 = service("ns", "six", Protocol::Tcp, "fd00:96::1", 80);
    state(vec![
        (
            web,
            vec![endpoint("10.244.1.1", 8080), endpoint("10.244.2.1", 8080)],
        ),
        (dns, vec![endpoint("10.244.1.2", 53)]),
        (v6, vec![endpoint("fd00:244::1", 8080)]),
    ])
}

#[test]
#[ignore = "runs inside the IPVS VM (ipvs_backend_suite_in_the_vm)"]
fn syncs_program_the_kernel_and_change_only_the_difference() {
    let rt = runtime();
    let mut backend = backend(Scheduler::Rr);
    rt.block_on(backend.cleanup()).expect("clean start");
    let report = sync(&rt, &mut backend, &web_state());
    assert!(report.skipped.is_empty());
    assert_eq!(
        report.rules_written, 10,
        "4 virtual servers + 6 real servers"
    );

    let ipvs = sh("ipvsadm -Ln");
    for line in [
        "TCP 10.96.0.1:80 rr",
        "-> 10.244.1.1:8080 Masq 1 0 0",
        "TCP 192.168.0.2:30080 rr",
        "UDP 10.96.0.10:53 rr",
        "TCP [fd00:96::1]:80 rr",
    ] {
        assert!(ipvs.contains(line), "{line}:\n{ipvs}");
    }
    let addrs = sh("ip -o addr show dev kube-ipvs0");
    for a in ["10.96.0.1/32", "10.96.0.10/32", "fd00:96::1/128"] {
        assert!(addrs.contains(a), "{a}: {addrs}");
    }
    assert!(sh("ipset list KUBE-CLUSTER-IP").contains("10.96.0.1,tcp:80"));
    assert!(sh("ipset list KUBE-NODE-PORT-TCP").contains("30080"));
    assert!(
        sh("iptables-save -t nat")
            .contains("-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT")
    );
    assert!(sh("ip6tables-save -t filter").contains("KUBE-6-IPVS-IPS"));
    assert!(sh("ipvsadm -L --timeout").contains("1800 120 300"));
    assert_eq!(sh("cat /proc/sys/net/ipv4/vs/conntrack"), "1");
    assert_eq!(sh("cat /proc/sys/net/ipv4/conf/all/arp_ignore"), "1");

    // What the kernel reports reads back as exactly what was planned: nothing to do.
    assert_eq!(sync(&rt, &mut backend, &web_state()).rules_written, 0);

    // Affinity on, one endpoint terminating, one added: edits in place, no delete+add.
    let mut next = web_state();
    let web = next
        .services
        .keys()
        .find(|k| k.service.name == "web")
        .expect("web")
        .clone();
    next.services.get_mut(&web).expect("web").session_affinity = Some(SessionAffinity {
        timeout: Duration::from_secs(600),
    });
    let eps = next.endpoints.get_mut(&web).expect("endpoints");
    eps[1].ready = false;
    eps[1].terminating = true;
    eps.push(endpoint("10.244.3.1", 8080));
    let report = sync(&rt, &mut backend, &next);
    // Two virtual servers (ClusterIP, NodePort) x (edit + reweight + add).
    assert_eq!(report.rules_written, 6);
    let ipvs = sh("ipvsadm -Ln");
    assert!(
        ipvs.contains("TCP 10.96.0.1:80 rr persistent 600"),
        "{ipvs}"
    );
    assert!(ipvs.contains("-> 10.244.2.1:8080 Masq 0 0 0"), "{ipvs}");
    assert!(ipvs.contains("-> 10.244.3.1:8080 Masq 1 0 0"), "{ipvs}");
    assert_eq!(sync(&rt, &mut backend, &next).rules_written, 0);

    // The UDP service goes: its virtual server, address and set entry with it.
    let dns = next
        .services
        .keys()
        .find(|k| k.service.name == "dns")
        .expect("dns")
        .clone();
    next.services.remove(&dns);
    next.endpoints.remove(&dns);
    assert_eq!(sync(&rt, &mut backend, &next).rules_written, 1);
    assert!(!sh("ipvsadm -Ln").contains("10.96.0.10"));
    assert!(!sh("ip -o addr show dev kube-ipvs0").contains("10.96.0.10/32"));
    assert!(!sh("ipset list KUBE-CLUSTER-IP").contains("10.96.0.10"));
    rt.block_on(backend.cleanup()).expect("cleanup");
}

#[test]
#[ignore = "runs inside the IPVS VM (ipvs_backend_suite_in_the_vm)"]
fn cleanup_leaves_no_trace() {
    let rt = runtime();
    let mut backend = backend(Scheduler::Mh);
    sync(&rt, &mut backend, &web_state());
    assert!(sh("ipvsadm -Ln").contains("mh (mh-port)"));
    rt.block_on(backend.cleanup()).expect("cleanup");
    let left = sh("ipvsadm -Ln");
    assert!(
        !left
            .lines()
            .any(|l| l.starts_with("TCP") || l.starts_with("UDP")),
        "{left}"
    );
    assert!(!sh("ip -o link show").contains("kube-ipvs0"));
    assert!(
        !sh("ipset list -n").contains("KUBE-"),
        "{}",
        sh("ipset list -n")
    );
    assert!(
        !sh("iptables-save").contains("KUBE-"),
        "{}",
        sh("iptables-save")
    );
    assert!(!sh("ip6tables-save").contains("KUBE-"));
    // Cleanup of nothing succeeds.
    rt.block_on(backend.cleanup()).expect("second cleanup");
    let _ = NetlinkIpvs::open().expect("open").services();
}
