//! The ipvs backend against fakes (each checked against the kernel: kp-ipvs's contract test,
//! the netns ipset tests in kp-rules): what a sync changes, and above all what it leaves
//! alone.

use std::collections::BTreeSet;
use std::time::Duration;

use kp_core::backend::{Backend, SyncKind};
use kp_core::model::{Protocol, SessionAffinity};
use kp_core::tracker::ProxyState;
use kp_ipvs::{FakeIpvs, Op, Protocol as P, Scheduler, ServiceKey, Timeouts};
use kp_rules::ipvs::IpvsConfig;

use super::*;
use crate::exec::{FakeRunner, RunnerCall};
use crate::sysctls::FakeSysctl;
use crate::testutil::{
    block_on, endpoint, ip, request, service, service_name, state, two_services,
};

mod verify;

struct Harness {
    backend: IpvsBackend<FakeIpvs, FakeLinks, FakeRunner, FakeIpset>,
    ipvs: FakeIpvs,
    links: FakeLinks,
    runner: FakeRunner,
    ipset: FakeIpset,
    sysctl: FakeSysctl,
}

fn harness(config: IpvsBackendConfig) -> Harness {
    let (ipvs, links, runner, ipset, sysctl) = (
        FakeIpvs::new(),
        FakeLinks::new(),
        FakeRunner::new(),
        FakeIpset::new(),
        FakeSysctl::new(),
    );
    let backend = IpvsBackend::with_parts(
        config,
        ipvs.clone(),
        links.clone(),
        runner.clone(),
        ipset.clone(),
        Box::new(sysctl.clone()),
    );
    Harness {
        backend,
        ipvs,
        links,
        runner,
        ipset,
        sysctl,
    }
}

fn config() -> IpvsBackendConfig {
    IpvsBackendConfig {
        families: vec![IpFamily::V4],
        plan: IpvsConfig {
            node_ips: vec![ip("192.168.0.2")],
            masquerade_bit: 14,
            ..IpvsConfig::default()
        },
        timeouts: Timeouts::default(),
        strict_arp: false,
        exclude_cidrs: Vec::new(),
        node_addresses: Vec::new(),
    }
}

fn key(addr: &str, port: u16) -> ServiceKey {
    ServiceKey {
        address: ip(addr),
        protocol: P::Tcp,
        port,
    }
}

impl Harness {
    fn sync(&mut self, state: &ProxyState) -> SyncReport {
        self.sync_as(state, SyncKind::Full)
    }

    /// A partial sync with nothing changed (a periodic run or a recheck).
    fn sync_partial(&mut self, state: &ProxyState) -> SyncReport {
        self.sync_as(state, SyncKind::Partial)
    }

    fn sync_as(&mut self, state: &ProxyState, kind: SyncKind) -> SyncReport {
        let changed = BTreeSet::new();
        block_on(self.backend.sync(&request(state, kind, &changed, false))).expect("sync succeeds")
    }

    /// Everything done to the kernel since the last call.
    fn changes(&self) -> (Vec<Op>, Vec<String>, usize, usize) {
        let restores = self
            .runner
            .calls()
            .iter()
            .filter(|c| matches!(c, RunnerCall::Restore { .. }))
            .count();
        self.runner.clear_calls();
        let ipset = self.ipset.restores().len();
        (
            self.ipvs.take_log(),
            self.links.take_changes(),
            restores,
            ipset,
        )
    }
}

#[test]
fn first_sync_programs_everything_and_an_identical_one_nothing() {
    let mut h = harness(config());
    let report = h.sync(&two_services());
    assert!(report.skipped.is_empty());
    let (ops, links, restores, ipset) = h.changes();
    assert_eq!(
        ops,
        vec![
            Op::AddService(key("10.96.0.1", 80)),
            Op::AddDest(key("10.96.0.1", 80), ip("10.244.1.1"), 8080),
            Op::AddService(key("10.96.0.2", 80)),
            Op::AddDest(key("10.96.0.2", 80), ip("10.244.1.2"), 8080),
        ]
    );
    assert_eq!(
        links,
        ["create kube-ipvs0", "add 10.96.0.1", "add 10.96.0.2"]
    );
    assert_eq!((restores, ipset), (1, 1));
    let sets = h.ipset.sets();
    assert_eq!(
        sets["KUBE-CLUSTER-IP"],
        BTreeSet::from(["10.96.0.1,tcp:80".to_owned(), "10.96.0.2,tcp:80".to_owned()])
    );

    // A full sync checks everything again but changes nothing in IPVS, links or sets.
    let report = h.sync(&two_services());
    assert_eq!(report.rules_written, 0);
    let (ops, links, restores, ipset) = h.changes();
    assert!(ops.is_empty(), "{ops:?}");
    assert!(links.is_empty(), "{links:?}");
    assert_eq!(
        restores, 1,
        "full syncs restore the rules (repairs a flushed table)"
    );
    assert_eq!(ipset, 1, "no new ipset restore");
    // A partial one does not even restore the unchanged rules.
    let changed = BTreeSet::new();
    let state = two_services();
    block_on(
        h.backend
            .sync(&request(&state, SyncKind::Partial, &changed, false)),
    )
    .expect("partial");
    let (ops, links, restores, ipset) = h.changes();
    assert!(ops.is_empty() && links.is_empty(), "{ops:?} {links:?}");
    assert_eq!((restores, ipset), (0, 1));
}

#[test]
fn an_endpoint_change_touches_only_that_real_server() {
    let mut h = harness(config());
    h.sync(&two_services());
    h.changes();
    let mut next = two_services();
    let a = next.services.keys().next().expect("a").clone();
    next.endpoints
        .get_mut(&a)
        .expect("a's endpoints")
        .push(endpoint("10.244.1.9", 8080));
    h.sync(&next);
    let (ops, links, _, _) = h.changes();
    assert_eq!(
        ops,
        vec![Op::AddDest(key("10.96.0.1", 80), ip("10.244.1.9"), 8080)]
    );
    assert!(links.is_empty());
}

#[test]
fn scheduler_and_affinity_changes_edit_in_place() {
    let mut h = harness(config());
    h.sync(&two_services());
    h.changes();
    let mut sticky = two_services();
    for svc in sticky.services.values_mut() {
        svc.session_affinity = Some(SessionAffinity {
            timeout: Duration::from_secs(300),
        });
    }
    h.sync(&sticky);
    let (ops, _, _, _) = h.changes();
    assert_eq!(
        ops,
        vec![
            Op::UpdateService(key("10.96.0.1", 80)),
            Op::UpdateService(key("10.96.0.2", 80)),
        ]
    );
    let listed = h.ipvs.clone().services().expect("list");
    assert!(
        listed
            .iter()
            .all(|v| v.timeout == 300 && v.flags == kp_ipvs::FLAG_PERSISTENT)
    );

    let mut sh = config();
    sh.plan.scheduler = Scheduler::Sh;
    let mut h2 = harness(sh);
    h2.ipvs = h.ipvs.clone();
    h2.backend.ipvs = h.ipvs.clone();
    h2.sync(&sticky);
    let (ops, _, _, _) = h2.changes();
    assert!(
        ops.iter().all(|op| matches!(op, Op::UpdateService(_))),
        "{ops:?}"
    );
}

#[test]
fn removed_endpoints_with_connections_drain_at_weight_zero() {
    let mut h = harness(config());
    h.sync(&two_services());
    h.ipvs
        .set_connections(&key("10.96.0.1", 80), ip("10.244.1.1"), 8080, 2, 1);
    h.changes();
    let mut next = two_services();
    let a = next.services.keys().next().expect("a").clone();
    next.endpoints.insert(a, vec![endpoint("10.244.1.5", 8080)]);
    h.sync(&next);
    let (ops, _, _, _) = h.changes();
    assert_eq!(
        ops,
        vec![
            Op::AddDest(key("10.96.0.1", 80), ip("10.244.1.5"), 8080),
            Op::UpdateDest(key("10.96.0.1", 80), ip("10.244.1.1"), 8080, 0),
        ]
    );
    // Still connected: left alone, and the runner is asked to look again in a minute.
    assert_eq!(h.backend.recheck_after(), Some(DRAIN_CHECK_INTERVAL));
    h.sync_partial(&next);
    assert!(h.changes().0.is_empty());
    assert_eq!(h.backend.recheck_after(), Some(DRAIN_CHECK_INTERVAL));
    // Drained: that recheck (a partial sync with nothing changed) deletes it.
    h.ipvs
        .set_connections(&key("10.96.0.1", 80), ip("10.244.1.1"), 8080, 0, 0);
    h.sync_partial(&next);
    assert_eq!(
        h.changes().0,
        vec![Op::DeleteDest(key("10.96.0.1", 80), ip("10.244.1.1"), 8080)]
    );
    assert_eq!(h.backend.recheck_after(), None);
}

#[test]
fn udp_real_servers_are_removed_at_once() {
    let mut h = harness(config());
    let dns = |eps| {
        state(vec![(
            service("kube-system", "dns", Protocol::Udp, "10.96.0.10", 53),
            eps,
        )])
    };
    h.sync(&dns(vec![
        endpoint("10.244.1.1", 53),
        endpoint("10.244.1.2", 53),
    ]));
    let udp = ServiceKey {
        address: ip("10.96.0.10"),
        protocol: P::Udp,
        port: 53,
    };
    h.ipvs.set_connections(&udp, ip("10.244.1.2"), 53, 0, 5);
    h.changes();
    h.sync(&dns(vec![endpoint("10.244.1.1", 53)]));
    assert_eq!(
        h.changes().0,
        vec![Op::DeleteDest(udp, ip("10.244.1.2"), 53)]
    );
}

#[test]
fn removed_services_lose_server_address_and_set_entries() {
    let mut h = harness(config());
    h.sync(&two_services());
    h.changes();
    let mut next = two_services();
    let b = next.services.keys().nth(1).expect("b").clone();
    next.services.remove(&b);
    next.endpoints.remove(&b);
    h.sync(&next);
    let (ops, links, _, _) = h.changes();
    assert_eq!(ops, vec![Op::DeleteService(key("10.96.0.2", 80))]);
    assert_eq!(links, ["del 10.96.0.2"]);
    assert_eq!(
        h.ipset.restores().last().map(String::as_str),
        Some("del KUBE-CLUSTER-IP 10.96.0.2,tcp:80 -exist\ndel KUBE-IPVS-IPS 10.96.0.2 -exist\n")
    );
}

#[test]
fn foreign_virtual_servers_are_left_alone() {
    let mut h = harness(config());
    let foreign = kp_ipvs::VirtualServer::new(key("172.16.0.9", 443), Scheduler::Wrr, None);
    h.ipvs.clone().add_service(&foreign).expect("add");
    h.sync(&two_services());
    assert!(h.ipvs.clone().services().expect("list").contains(&foreign));
}

#[test]
fn node_ports_on_node_addresses_no_longer_allowed_are_stale() {
    // An earlier run served NodePorts on every node address; nodePortAddresses now allows
    // only the node IP (plan.node_ips), the second address is still the node's.
    let old = kp_ipvs::VirtualServer::new(key("192.168.0.3", 30080), Scheduler::Rr, None);
    let run = |node_addresses: Vec<IpAddr>| {
        let mut h = harness(IpvsBackendConfig {
            node_addresses,
            ..config()
        });
        h.ipvs.clone().add_service(&old).expect("add");
        h.sync(&two_services());
        h.ipvs.clone().services().expect("list")
    };
    assert!(!run(vec![ip("192.168.0.3")]).contains(&old));
    // Not an address of this node: someone else's, left alone.
    assert!(run(Vec::new()).contains(&old));
}

#[test]
fn virtual_servers_inside_exclude_cidrs_are_never_deleted_as_stale() {
    // Another agent's virtual servers on the node IP (an address kube-proxy manages).
    let theirs = kp_ipvs::VirtualServer::new(key("192.168.0.2", 8443), Scheduler::Wrr, None);
    let stale_node_port =
        kp_ipvs::VirtualServer::new(key("192.168.0.2", 30080), Scheduler::Rr, None);
    let run = |exclude: Vec<ipnet::IpNet>| {
        let mut h = harness(IpvsBackendConfig {
            exclude_cidrs: exclude,
            ..config()
        });
        let mut ipvs = h.ipvs.clone();
        ipvs.add_service(&theirs).expect("add");
        ipvs.add_service(&stale_node_port).expect("add");
        h.sync(&two_services());
        h.ipvs.clone().services().expect("list")
    };
    // Without excludeCIDRs both go: they are on a node IP and no service wants them.
    let left = run(Vec::new());
    assert!(
        !left.contains(&theirs) && !left.contains(&stale_node_port),
        "{left:?}"
    );
    let exclude = vec!["192.168.0.2/32".parse().expect("cidr")];
    let left = run(exclude);
    assert!(
        left.contains(&theirs) && left.contains(&stale_node_port),
        "{left:?}"
    );
}

#[test]
fn one_refused_virtual_server_skips_only_its_service() {
    let mut h = harness(config());
    h.ipvs.fail_on(Op::AddService(key("10.96.0.1", 80)));
    let report = h.sync(&two_services());
    assert_eq!(report.skipped.len(), 1);
    assert_eq!(report.skipped[0].name, "a");
    let listed = h.ipvs.clone().services().expect("list");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].key, key("10.96.0.2", 80));
    // The next sync retries it.
    let report = h.sync(&two_services());
    assert!(report.skipped.is_empty());
    assert_eq!(h.ipvs.clone().services().expect("list").len(), 2);
}

#[test]
fn setup_applies_timeouts_sysctls_and_jumps_once() {
    let mut c = config();
    c.timeouts = Timeouts {
        tcp: 1200,
        tcp_fin: 0,
        udp: 0,
    };
    c.strict_arp = true;
    let mut h = harness(c);
    h.runner.save_modelled();
    for setting in sysctl_plan(true) {
        h.sysctl.set(setting.key, "0");
    }
    h.sync(&two_services());
    assert_eq!(h.ipvs.clone().timeouts().expect("t").tcp, 1200);
    let writes = h.sysctl.writes();
    for key in [
        "proc/sys/net/ipv4/vs/conntrack",
        "proc/sys/net/ipv4/conf/all/arp_ignore",
        "proc/sys/net/ipv4/conf/all/arp_announce",
    ] {
        assert!(writes.iter().any(|(k, _)| k == key), "{key}: {writes:?}");
    }
    // The jumps go in with the rules' restore: no `iptables` run per chain or jump.
    let inserted = |runner: &FakeRunner| {
        let calls = runner.calls();
        assert!(
            !calls.iter().any(|c| matches!(c, RunnerCall::Run { .. })),
            "{calls:?}"
        );
        runner
            .restores()
            .iter()
            .flat_map(|(_, input)| input.lines().filter(|l| l.starts_with("-I ")))
            .count()
    };
    assert_eq!(inserted(&h.runner), rules::setup().jumps.len());
    h.changes();
    h.backend.kernel_changed_behind_our_back();
    h.sync(&two_services());
    assert_eq!(
        inserted(&h.runner),
        0,
        "jumps in place are not inserted again"
    );
}

#[test]
fn cleanup_removes_everything_ipvs_mode_made() {
    let mut h = harness(config());
    h.sync(&two_services());
    block_on(h.backend.cleanup()).expect("cleanup");
    assert!(h.ipvs.clone().services().expect("list").is_empty());
    assert_eq!(h.links.addresses_of("kube-ipvs0"), None);
    assert!(h.ipset.sets().is_empty(), "{:?}", h.ipset.sets());
}

#[test]
fn partial_syncs_read_back_only_what_changed() {
    let mut h = harness(config());
    h.sync(&two_services());
    let none = BTreeSet::new();
    // As the core sends them: a partial sync names the services changed since the last one.
    let only_a = BTreeSet::from([service_name("ns", "a")]);
    let partial = |h: &mut Harness, state: &ProxyState, changed: &BTreeSet<ServiceName>| {
        block_on(
            h.backend
                .sync(&request(state, SyncKind::Partial, changed, false)),
        )
        .expect("partial sync")
    };
    let before = h.ipvs.destination_lists();
    partial(&mut h, &two_services(), &none);
    assert_eq!(
        h.ipvs.destination_lists(),
        before,
        "nothing changed: nothing read back"
    );
    let mut next = two_services();
    let a = next.services.keys().next().expect("a").clone();
    next.endpoints
        .get_mut(&a)
        .expect("a's endpoints")
        .push(endpoint("10.244.1.9", 8080));
    h.changes();
    partial(&mut h, &next, &only_a);
    assert_eq!(
        h.ipvs.destination_lists(),
        before + 1,
        "only a's virtual server"
    );
    assert_eq!(
        h.changes().0,
        vec![Op::AddDest(key("10.96.0.1", 80), ip("10.244.1.9"), 8080)]
    );
    // A full sync reads everything back (and repairs what someone else changed).
    h.ipvs
        .clone()
        .delete_destination(
            &key("10.96.0.2", 80),
            &RealServer::new(ip("10.244.1.2"), 8080, 1),
        )
        .expect("foreign change");
    partial(&mut h, &next, &none);
    assert!(
        h.ipvs
            .clone()
            .destinations(&key("10.96.0.2", 80))
            .expect("list")
            .is_empty()
    );
    h.sync(&next);
    assert_eq!(
        h.ipvs
            .clone()
            .destinations(&key("10.96.0.2", 80))
            .expect("list")
            .len(),
        1
    );
}

#[test]
fn replaced_udp_endpoints_lose_their_conntrack_entries() {
    let h = harness(config());
    let conntrack = crate::conntrack::FakeConntrack::new();
    let mut backend = h.backend.with_conntrack(conntrack.clone());
    let dns = |ep| {
        state(vec![(
            service("kube-system", "dns", Protocol::Udp, "10.96.0.10", 53),
            vec![endpoint(ep, 53)],
        )])
    };
    let changed = BTreeSet::new();
    let first = dns("10.244.1.1");
    block_on(backend.sync(&request(&first, SyncKind::Full, &changed, true))).expect("first");
    assert!(
        conntrack.deleted().is_empty(),
        "nothing is stale before a previous state"
    );
    let second = dns("10.244.1.2");
    block_on(backend.sync(&request(&second, SyncKind::Full, &changed, true))).expect("second");
    let deleted = conntrack.deleted();
    assert_eq!(deleted.len(), 1, "{deleted:?}");
    assert_eq!(deleted[0].orig_dst, Some(ip("10.96.0.10")));
    assert_eq!(deleted[0].reply_src, Some(ip("10.244.1.1")));
}

/// `n` TCP services `ns/s{i}` on 10.96.x.y:80 with two endpoints each; every third has a
/// NodePort.
fn many_services(n: u32) -> ProxyState {
    let nth = |base: [u8; 2], i: u32| {
        let [_, _, y, z] = i.to_be_bytes();
        format!("{}.{}.{y}.{z}", base[0], base[1])
    };
    state(
        (0..n)
            .map(|i| {
                let mut svc = service(
                    "ns",
                    &format!("s{i}"),
                    Protocol::Tcp,
                    &nth([10, 96], i + 1),
                    80,
                );
                if i % 3 == 0 {
                    svc.node_port = Some(30000 + u16::try_from(i / 3).expect("few NodePorts"));
                }
                let eps = (0..2)
                    .map(|e| endpoint(&nth([10, 128], i * 2 + e + 1), 8080))
                    .collect();
                (svc, eps)
            })
            .collect(),
    )
}

impl Harness {
    /// Requests to the kernel since the last call: IPVS netlink requests, rtnetlink
    /// requests, `ipset save`s, `ipset restore`s and `iptables-restore`s.
    fn requests(
        &self,
        since: &mut (usize, usize, usize, usize),
    ) -> (usize, usize, usize, usize, usize) {
        let now = (
            self.ipvs.requests(),
            self.links.requests(),
            self.ipset.saves(),
            self.ipset.restores().len(),
        );
        let restores = self
            .runner
            .calls()
            .iter()
            .filter(|c| matches!(c, RunnerCall::Restore { .. }))
            .count();
        self.runner.clear_calls();
        let delta = (
            now.0 - since.0,
            now.1 - since.1,
            now.2 - since.2,
            now.3 - since.3,
            restores,
        );
        *since = now;
        delta
    }

    fn sync_changed(&mut self, state: &ProxyState, changed: &[&str]) -> SyncReport {
        let changed: BTreeSet<ServiceName> =
            changed.iter().map(|n| service_name("ns", n)).collect();
        block_on(
            self.backend
                .sync(&request(state, SyncKind::Partial, &changed, false)),
        )
        .expect("partial sync")
    }
}

#[test]
fn a_one_service_change_costs_the_same_among_a_thousand_services() {
    let mut h = harness(config());
    let mut s = many_services(1000);
    h.sync(&s);
    let mut since = (0, 0, 0, 0);
    let (ipvs, links, saves, _, _) = h.requests(&mut since);
    assert!(ipvs > 1000, "the first sync programs everything: {ipvs}");
    assert_eq!(
        (links, saves),
        (2 + 1000, 1),
        "it lists kube-ipvs0 and the ipsets once, then adds each ClusterIP"
    );
    h.changes();

    // One more endpoint for a NodePort service: two real servers added, each after reading
    // its virtual server's real servers back. Nothing listed, no ipset or rules touched.
    let s0 = s
        .services
        .keys()
        .find(|n| n.service.name == "s0")
        .expect("s0")
        .clone();
    s.endpoints
        .get_mut(&s0)
        .expect("s0's endpoints")
        .push(endpoint("10.250.0.1", 8080));
    h.sync_changed(&s, &["s0"]);
    assert_eq!(h.requests(&mut since), (4, 0, 0, 0, 0));
    let (ops, links, _, _) = h.changes();
    assert_eq!(
        ops,
        vec![
            Op::AddDest(key("10.96.0.1", 80), ip("10.250.0.1"), 8080),
            Op::AddDest(key("192.168.0.2", 30000), ip("10.250.0.1"), 8080),
        ]
    );
    assert!(links.is_empty());

    // A new service: its virtual server and real servers, its address, its set entries.
    let mut next = many_services(1000);
    next.endpoints = s.endpoints.clone();
    let new = service("ns", "new", Protocol::Tcp, "10.97.0.1", 80);
    next.endpoints
        .insert(new.name.clone(), vec![endpoint("10.251.0.1", 8080)]);
    next.services.insert(new.name.clone(), new.clone());
    h.sync_changed(&next, &["new"]);
    assert_eq!(h.requests(&mut since), (2, 1, 0, 1, 0));
    assert_eq!(
        h.ipset.restores().last().map(String::as_str),
        Some("add KUBE-CLUSTER-IP 10.97.0.1,tcp:80 -exist\nadd KUBE-IPVS-IPS 10.97.0.1 -exist\n")
    );

    // And gone again: one delete each, found without listing.
    next.services.remove(&new.name);
    next.endpoints.remove(&new.name);
    h.changes();
    h.sync_changed(&next, &["new"]);
    assert_eq!(h.requests(&mut since), (1, 1, 0, 1, 0));
    let (ops, links, _, _) = h.changes();
    assert_eq!(ops, vec![Op::DeleteService(key("10.97.0.1", 80))]);
    assert_eq!(links, ["del 10.97.0.1"]);

    // A full resync still lists and reads back everything.
    h.sync(&next);
    let (ipvs, links, saves, _, restores) = h.requests(&mut since);
    assert!(ipvs > 1000, "{ipvs}");
    assert_eq!((links, saves, restores), (2, 1, 1));
}

#[test]
fn partial_syncs_after_a_failure_reconcile_against_the_kernel() {
    let mut h = harness(config());
    let s = two_services();
    h.sync(&s);
    // Someone deletes a virtual server and an address behind our back; a partial sync
    // trusts what it programmed and does not notice.
    h.ipvs
        .clone()
        .delete_service(&key("10.96.0.2", 80))
        .expect("delete");
    block_on(h.links.clone().delete_address(10, ip("10.96.0.2"))).expect("delete address");
    h.changes();
    h.sync_partial(&s);
    assert!(h.changes().0.is_empty());
    assert_eq!(h.links.addresses_of("kube-ipvs0").map(|a| a.len()), Some(1));
    // A sync that fails (its rules restore, after the addresses were listed and repaired):
    // the next one, though asked to be partial, lists the kernel and repairs the rest.
    h.runner.fail_next_restores(1);
    let changed = BTreeSet::new();
    block_on(
        h.backend
            .sync(&request(&s, SyncKind::Full, &changed, false)),
    )
    .expect_err("fails");
    assert_eq!(h.changes().1, ["add 10.96.0.2"]);
    h.sync_partial(&s);
    let (ops, _, _, _) = h.changes();
    assert_eq!(
        ops,
        vec![
            Op::AddService(key("10.96.0.2", 80)),
            Op::AddDest(key("10.96.0.2", 80), ip("10.244.1.2"), 8080),
        ]
    );
}

#[test]
fn a_virtual_server_the_bookkeeping_does_not_know_is_updated_not_added_twice() {
    let mut h = harness(config());
    let s = two_services();
    // Adding a's real server fails after its virtual server was made: a is skipped and its
    // state unknown.
    h.ipvs
        .fail_on(Op::AddDest(key("10.96.0.1", 80), ip("10.244.1.1"), 8080));
    let report = h.sync(&s);
    assert_eq!(report.skipped.len(), 1);
    h.changes();
    // The retry (partial, a named as changed) finds it in the kernel and completes it.
    let report = h.sync_changed(&s, &["a"]);
    assert!(report.skipped.is_empty(), "{:?}", report.skipped);
    assert_eq!(
        h.changes().0,
        vec![
            Op::UpdateService(key("10.96.0.1", 80)),
            Op::AddDest(key("10.96.0.1", 80), ip("10.244.1.1"), 8080),
        ]
    );
}
