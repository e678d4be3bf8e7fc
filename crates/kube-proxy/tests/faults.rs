//! The fault suite: the real `kube-proxy` binary watches a fake API server process
//! (`kp_testbed::apiserver`, run by `kp-echo apiserver` inside the node namespace) and
//! programs a kernel mode, while a client pod keeps opening new connections to a Service and
//! holds a long-lived one. Then things break:
//!
//! - the proxy gets SIGTERM and SIGKILL and is started again, and a full resync is forced
//!   (the Node's labels change): no connection fails, the long-lived one keeps working;
//! - the API server is frozen (SIGSTOP: connections hang) and then killed (connections are
//!   refused) for [`OUTAGE`] each: nothing fails meanwhile, `/healthz` answers, and a Service
//!   created once it is back (after the restart: a new server whose history starts at a fresh
//!   resourceVersion, so the proxy's watches get `410 Gone` and relist) carries traffic within
//!   seconds. The outage is logged once and counted once;
//! - the kernel refuses every sync (module `refused`): `/healthz` turns 503 within the
//!   health window, with the reason, a log line and a metric, and 200 once syncs succeed;
//! - the manifests file is rewritten by every way tools write files (module `rewrites`): no
//!   connection fails, every edit arrives, no half-written file is read;
//! - another program removes the proxy's rules (module `heal`): they come back within
//!   seconds, logged and counted once per event, and other programs' rules survive (ipvs
//!   mode: `ipvsadm -C`, deleting `kube-ipvs0`, a firewalld-style reload, a service address
//!   deleted in a loop).
//!
//! iptables and nftables modes run here; ipvs mode runs the same scenarios inside the test VM
//! (tools/kp-vm) with shorter outages, as the traffic suite's `ipvs::` scenarios do. Needs
//! root; build the helpers first: `cargo build -p kp-testbed --bins`.

#[path = "faults/heal.rs"]
mod heal;
#[path = "faults/refused.rs"]
mod refused;
#[path = "faults/rewrites.rs"]
mod rewrites;
use kp_suite::support;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kp_testbed::apiserver::FakeApiProcess;
use kp_testbed::proxy::SYNCED_LOG;
use kp_testbed::{Cluster, Outcome, Session};
use support::{CLUSTER_CIDR_V4, Flags, Mode, Proxy, Service, http_get_path, metric_sum, node_yaml};

/// How long each API server outage lasts on the host (the 30 s).
const OUTAGE: Duration = Duration::from_secs(30);
/// The same inside the VM, where everything is slower and the suite must stay small.
const VM_OUTAGE: Duration = Duration::from_secs(10);
/// How often `/healthz` is checked during an outage.
const HEALTH_EVERY: Duration = Duration::from_secs(5);
/// Bound for "programmed within seconds" after the API server answers again: after a 30 s
/// outage the first retry of the proxy's four watchers comes at most ~13 s after the restart
/// (the default 30 s cap; bench/notes/2026-12-02-api-backoff.md), and it wakes the others;
/// short of the ~40 s a proxy waiting out a grown watch backoff took. The measured time is
/// printed.
const EVENTUALLY: Duration = Duration::from_secs(20);
/// A connection slower than this counts as failed (generous for a loaded 2-core machine).
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);
/// New connections per probe process of the load thread...
const LOAD_BATCH: usize = 5;
/// ...and the pause after each: some 20-40 new connections a second, steady without
/// eating the machine's two cores.
const LOAD_PAUSE: Duration = Duration::from_millis(100);
/// How long the load runs on between the steps of the proxy-restart scenario.
const SETTLE: Duration = Duration::from_secs(1);
/// Where the fake API server listens inside the node namespace.
const API_ADDRESS: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 6443);
/// Namespace prefix of this suite's clusters.
const PREFIX: &str = "kpf-";
/// The Service the load goes to.
const STEADY_IP: &str = "10.96.0.50";

fn ip(text: &str) -> IpAddr {
    text.parse().expect("literal address")
}

/// A cluster, the fake API server in its node namespace, and how to start the proxy.
struct World {
    mode: Mode,
    cluster: Cluster,
    api: FakeApiProcess,
    state: tempfile::TempDir,
    flags: Flags,
}

/// An IPv4 cluster with pods `a` and `b`, its namespaces named from `prefix`.
fn two_pods(prefix: &str) -> Cluster {
    Cluster::builder()
        .prefix(prefix)
        .pod("a")
        .pod("b")
        .dual_stack(false)
        .probe_timeout(PROBE_TIMEOUT)
        .build()
        .expect("test cluster builds")
}

impl World {
    /// Pods `a` and `b`, this Node and the steady Service over both pods.
    fn new(mode: Mode) -> Self {
        let cluster = two_pods(PREFIX);
        let api = FakeApiProcess::start(cluster.echo_binary_path(), cluster.node_ns(), API_ADDRESS)
            .expect("fake API server starts");
        let steady = Service::new("steady", STEADY_IP)
            .tcp(80)
            .endpoints(&cluster, &["a", "b"]);
        api.apply_yaml(&node_yaml(&cluster, 0)).expect("Node");
        api.apply_yaml(&steady.yaml()).expect("steady Service");
        let flags = Flags::cluster_cidr(CLUSTER_CIDR_V4).master(api.url());
        Self {
            mode,
            cluster,
            api,
            state: tempfile::tempdir().expect("state tempdir"),
            flags,
        }
    }

    /// Starts the proxy and waits for its first sync.
    fn start_proxy(&self) -> Proxy {
        self.start_proxy_in(self.mode)
    }

    /// Starts the proxy in `mode` (another layout of the world's mode) and waits for its
    /// first sync.
    fn start_proxy_in(&self, mode: Mode) -> Proxy {
        // The manifests directory is not used with `--master`.
        let unused = Path::new("/nonexistent");
        Proxy::start(mode, &self.cluster, unused, self.state.path(), &self.flags)
    }

    /// A long-lived connection to the steady Service and the pod that answered it.
    fn session(&self) -> (Session, String) {
        let session = self
            .cluster
            .connect(self.cluster.client(), ip(STEADY_IP), 80)
            .expect("open a long-lived connection");
        let pod = session
            .greeting()
            .pod()
            .unwrap_or_else(|| panic!("long-lived connection: {:?}", session.greeting()))
            .to_owned();
        (session, pod)
    }
}

/// `/healthz` of `proxy` answers 200.
fn assert_healthy(cluster: &Cluster, proxy: &Proxy, when: &str) {
    let response = http_get_path(cluster, cluster.node(), proxy.healthz_address(), "/healthz");
    assert_eq!(
        response.status,
        200,
        "/healthz {when}: {response:?}\n{}",
        proxy.tail()
    );
}

/// Waits (bounded by [`EVENTUALLY`]) until a connection to `addr` is answered by one of
/// `pods`; returns how long it took.
fn eventually_answered(cluster: &Cluster, addr: IpAddr, pods: &[&str], proxy: &Proxy) -> Duration {
    let start = Instant::now();
    loop {
        let outcome = cluster.tcp(cluster.client(), addr, 80).expect("probe runs");
        if pods.iter().any(|p| outcome.answered_by(p)) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < EVENTUALLY,
            "{addr}:80 not answered within {EVENTUALLY:?} (last: {outcome:?}); log:\n{}",
            proxy.tail()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Sends a line on the long-lived connection: the same pod must answer.
fn echo(session: &mut Session, pod: &str, step: &str, proxy: &Proxy) {
    let outcome = session
        .send(step)
        .unwrap_or_else(|e| panic!("long-lived connection broke {step}: {e}\n{}", proxy.tail()));
    assert!(
        outcome.answered_by(pod),
        "long-lived connection {step}: {outcome:?} (was {pod})\n{}",
        proxy.tail()
    );
}

/// Runs `body` while another thread keeps opening new connections to the steady Service;
/// returns `body`'s result and every connection's outcome.
fn under_load<R>(cluster: &Cluster, body: impl FnOnce() -> R) -> (R, Vec<Outcome>) {
    /// Stops the load when dropped, so a failing `body` fails the test instead of leaving
    /// the scope waiting for the load thread forever.
    struct StopOnDrop<'a>(&'a AtomicBool);
    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let load = scope.spawn(|| {
            let mut outcomes = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let tally = cluster
                    .tcp_repeat(cluster.client(), ip(STEADY_IP), 80, LOAD_BATCH)
                    .expect("load probe runs");
                outcomes.extend(tally.outcomes().iter().cloned());
                std::thread::sleep(LOAD_PAUSE);
            }
            outcomes
        });
        let result = {
            let _stop = StopOnDrop(&stop);
            body()
        };
        let outcomes = load.join().expect("load thread");
        (result, outcomes)
    })
}

/// Every connection of the load was answered by one of the endpoints, and there were enough
/// of them to mean something.
fn assert_none_failed(outcomes: &[Outcome], what: &str, at_least: usize) {
    let failed: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| !(o.answered_by("a") || o.answered_by("b")))
        .collect();
    assert!(
        failed.is_empty(),
        "{what}: {} of {} new connections failed: {failed:?}",
        failed.len(),
        outcomes.len()
    );
    assert!(
        outcomes.len() >= at_least,
        "{what}: only {} connections were made",
        outcomes.len()
    );
    println!("{what}: {} new connections, all answered", outcomes.len());
}

/// SIGTERM and SIGKILL of the proxy, each followed by a new proxy, and a forced full resync,
/// all under new and long-lived connections.
fn proxy_restarts(mode: Mode) {
    let world = World::new(mode);
    let mut proxy = Some(world.start_proxy());
    let (mut session, pod) = world.session();
    let cluster = &world.cluster;
    let ((), outcomes) = under_load(cluster, || {
        let running = proxy.take().expect("proxy");
        let tail = running.tail();
        let status = running.terminate();
        assert!(status.success(), "exit after SIGTERM: {status}\n{tail}");
        let started = world.start_proxy();
        echo(&mut session, &pod, "after-sigterm", &started);
        std::thread::sleep(SETTLE);

        started.kill();
        let mut started = world.start_proxy();
        echo(&mut session, &pod, "after-sigkill", &started);
        std::thread::sleep(SETTLE);

        // A Node label change makes the next sync a full one.
        started.mark();
        world.api.apply_yaml(&node_yaml(cluster, 1)).expect("Node");
        started.wait_for("a full sync after the Node changed", |l| {
            l.contains(SYNCED_LOG) && l.contains("kind=\"Full\"")
        });
        echo(&mut session, &pod, "after-full-resync", &started);
        std::thread::sleep(SETTLE);
        proxy = Some(started);
    });
    assert_none_failed(&outcomes, "proxy restarts and a full resync", 10);
}

/// What an upgrade meets on a node: iptables mode's rules, then nftables mode (the default
/// layout), a rollback to the chain layout and forward again, under new and long-lived
/// connections. Each start adopts what the last left (nftables replaces either layout's table
/// in one transaction and removes iptables mode's chains once its own rules are in), so no
/// connection fails.
fn modes_switch_under_traffic() {
    let world = World::new(Mode::Nftables);
    let mut proxy = Some(world.start_proxy_in(Mode::Iptables));
    let (mut session, pod) = world.session();
    let cluster = &world.cluster;
    let node = |argv: &[&str]| cluster.exec(cluster.node_ns(), argv).unwrap_or_default();
    // The verdict-free layout's own chain and map, and iptables mode's entry chain.
    let state = || {
        let table = node(&["nft", "list", "table", "ip", "kube-proxy"]);
        let maps = table.contains("chain dispatch {") && table.contains("map endpoints-2-tcp {");
        let chains = table.contains("map service-ips {");
        let iptables = node(&["iptables-save", "-t", "nat"]).contains(":KUBE-SERVICES");
        (maps, chains, iptables)
    };
    let ((), outcomes) = under_load(cluster, || {
        for (mode, step, want) in [
            (
                Mode::Nftables,
                "from-iptables-to-nftables",
                (true, false, false),
            ),
            (
                Mode::NftablesChains,
                "back-to-the-chain-layout",
                (false, true, false),
            ),
            (
                Mode::Nftables,
                "forward-to-maps-again",
                (true, false, false),
            ),
        ] {
            let running = proxy.take().expect("proxy");
            let status = running.terminate();
            assert!(status.success(), "exit after SIGTERM: {status}");
            let started = world.start_proxy_in(mode);
            echo(&mut session, &pod, step, &started);
            // iptables mode's chains go once nftables mode's first sync is in: soon after.
            let deadline = Instant::now() + Duration::from_secs(10);
            while state() != want && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(100));
            }
            assert_eq!(state(), want, "{step}: (maps, chains, iptables)");
            std::thread::sleep(SETTLE);
            proxy = Some(started);
        }
    });
    assert_none_failed(&outcomes, "switching modes and layouts", 10);
}

/// Keeps checking `/healthz` for `outage`.
fn healthy_for(cluster: &Cluster, proxy: &Proxy, outage: Duration, what: &str) {
    let end = Instant::now() + outage;
    while Instant::now() < end {
        assert_healthy(cluster, proxy, what);
        std::thread::sleep(HEALTH_EVERY.min(end.saturating_duration_since(Instant::now())));
    }
}

/// The API server frozen, then killed, for `outage` each, under new and long-lived
/// connections; Services created after each comes back carry traffic within seconds.
fn api_server_outages(mode: Mode, outage: Duration) {
    let world = World::new(mode);
    let mut proxy = world.start_proxy();
    let (mut session, pod) = world.session();
    let after_stop = Service::new("after-stop", "10.96.0.51")
        .tcp(80)
        .endpoints(&world.cluster, &["a"]);
    let after_kill = Service::new("after-kill", "10.96.0.52")
        .tcp(80)
        .endpoints(&world.cluster, &["b"]);
    let cluster = &world.cluster;
    let (recovery, outcomes) = under_load(cluster, || {
        world.api.pause().expect("SIGSTOP");
        healthy_for(cluster, &proxy, outage, "while the API server is stopped");
        echo(&mut session, &pod, "during-sigstop", &proxy);
        world.api.resume().expect("SIGCONT");
        world.api.apply_yaml(&after_stop.yaml()).expect("Service");
        let took = eventually_answered(cluster, ip("10.96.0.51"), &["a"], &proxy);
        println!("{mode:?}: Service created after SIGCONT answered after {took:?}");

        world.api.kill();
        healthy_for(cluster, &proxy, outage, "while the API server is down");
        echo(&mut session, &pod, "during-kill", &proxy);
        proxy.mark();
        let restarted = Instant::now();
        world.api.restart().expect("API server restarts");
        world.api.apply_yaml(&after_kill.yaml()).expect("Service");
        // The relist after `410 Gone` brings the new Service: the first sync that changes
        // anything programs it (the probe below checks that it does).
        proxy.wait_change_synced();
        let synced = restarted.elapsed();
        eventually_answered(cluster, ip("10.96.0.52"), &["b"], &proxy);
        (synced, restarted.elapsed())
    });
    println!(
        "{mode:?}: API server restart -> new Service synced after {:?}, answered after {:?} \
         (probes time out after {PROBE_TIMEOUT:?})",
        recovery.0, recovery.1
    );
    assert_none_failed(&outcomes, "API server outages", 10);
    echo(&mut session, &pod, "after-outages", &proxy);

    // Logged and counted once: the freeze hung connections without failing a request, the
    // kill was one outage.
    // The recovery is logged once every watch is back in step, which may be after the new
    // Service is programmed (another kind's retry may still be due).
    let is_recovery = |l: &str| l.contains("watches recovered from the API server outage");
    let deadline = Instant::now() + EVENTUALLY;
    while proxy.logged(is_recovery).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let lost = proxy.logged(|l| l.contains("API server unreachable"));
    let back = proxy.logged(|l| l.contains("API server answers again"));
    let recovered = proxy.logged(is_recovery);
    assert_eq!(
        (lost.len(), back.len(), recovered.len()),
        (1, 1, 1),
        "{lost:?} {back:?} {recovered:?}\n{}",
        proxy.tail()
    );
    println!("{mode:?}: {}\n{}\n{}", lost[0], back[0], recovered[0]);
    let metrics = http_get_path(cluster, cluster.node(), proxy.metrics_address(), "/metrics");
    let outages = metric_sum(&metrics.body, "kube_proxy_rs_api_server_outages_total");
    assert_eq!(outages, Some(1.0), "{}", metrics.body);
    let relists = metric_sum(&metrics.body, "kube_proxy_rs_watch_relists_total");
    assert!(
        relists.is_some_and(|n| n >= 1.0),
        "relisted after the restart: {}",
        metrics.body
    );
}

/// The objects of `service`'s YAML, with what a real API server keeps in fields the proxy
/// never reads: Go's zero time as `null` in `status.conditions` (Kubernetes' conformance spec
/// "should complete a service status lifecycle" writes one), a malformed timestamp.
fn odd_objects(service: &Service) -> Vec<serde_json::Value> {
    let mut objects = kp_testbed::apiserver::yaml_objects(&service.yaml()).expect("YAML");
    for obj in &mut objects {
        obj["metadata"]["creationTimestamp"] = serde_json::json!("not a time");
        obj["status"]["conditions"] = serde_json::json!([{ "type": "StatusUpdate",
            "status": "True", "reason": "E2E", "message": "x", "lastTransitionTime": null }]);
    }
    objects
}

/// Whether a connection to `addr`:80 reaches `pod` within [`EVENTUALLY`] (`want`), or
/// stops reaching it (`!want`); returns how long that took.
fn eventually(cluster: &Cluster, addr: IpAddr, pod: &str, want: bool, proxy: &Proxy) -> Duration {
    eventually_on(cluster, (addr, 80), pod, want, proxy)
}

/// [`eventually`] on another port.
fn eventually_on(
    cluster: &Cluster,
    (addr, port): (IpAddr, u16),
    pod: &str,
    want: bool,
    proxy: &Proxy,
) -> Duration {
    let start = Instant::now();
    loop {
        let outcome = cluster
            .tcp(cluster.client(), addr, port)
            .expect("probe runs");
        if outcome.answered_by(pod) == want {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < EVENTUALLY,
            "{addr}:{port} answered by {pod}: still {outcome:?} after {EVENTUALLY:?}; log:\n{}",
            proxy.tail()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Objects the API server accepts but a strict decode refuses, present when the proxy starts
/// and changed while it runs: everything else is programmed and keeps carrying traffic, the
/// odd Service works, a version of it whose port does not decode is skipped (its last good
/// rules stay), and its deletion applies whatever its body holds.
fn odd_objects_lose_only_themselves(mode: Mode) {
    let world = World::new(mode);
    let odd = Service::new("odd", "10.96.0.53")
        .tcp(80)
        .endpoints(&world.cluster, &["a"]);
    for obj in odd_objects(&odd) {
        world.api.apply(obj).expect("odd objects");
    }
    let mut proxy = world.start_proxy();
    let cluster = &world.cluster;
    eventually(cluster, ip("10.96.0.53"), "a", true, &proxy);
    let ((), outcomes) = under_load(cluster, || {
        let mut broken = odd_objects(&odd).remove(0);
        assert_eq!(broken["kind"], "Service");
        broken["spec"]["ports"][0]["port"] = serde_json::json!("eighty");
        proxy.mark();
        world.api.apply(broken).expect("broken Service");
        proxy.wait_for("the broken version skipped", |l| {
            l.contains("skipping an object the proxy cannot use")
        });
        let outcome = cluster
            .tcp(cluster.client(), ip("10.96.0.53"), 80)
            .expect("probe");
        assert!(
            outcome.answered_by("a"),
            "last good rules kept: {outcome:?}"
        );
        world.api.delete("Service", "default/odd").expect("delete");
        let took = eventually(cluster, ip("10.96.0.53"), "a", false, &proxy);
        println!("{mode:?}: the odd Service's deletion took effect after {took:?}");
    });
    assert_none_failed(&outcomes, "odd objects", 10);
    let skipped = proxy.logged(|l| l.contains("skipping an object the proxy cannot use"));
    assert_eq!(skipped.len(), 1, "{skipped:?}");
    assert!(skipped[0].len() < 400, "one short line: {}", skipped[0]);
    let metrics = http_get_path(cluster, cluster.node(), proxy.metrics_address(), "/metrics");
    let count = metric_sum(&metrics.body, "kube_proxy_rs_watch_skipped_objects_total");
    assert_eq!(count, Some(1.0), "{}", metrics.body);
    let failures = metric_sum(&metrics.body, "kube_proxy_rs_watch_failures_total");
    assert_eq!(failures, None, "no list or watch failed: {}", metrics.body);
}

/// Whether `sh -c script` in the node namespace exits 0 within [`EVENTUALLY`] (`want`) or
/// stops doing so (`!want`); returns how long that took.
fn eventually_sh(world: &World, script: &str, want: bool, proxy: &Proxy) -> Duration {
    let start = Instant::now();
    loop {
        let ok = world
            .cluster
            .exec(world.cluster.node_ns(), &["sh", "-c", script])
            .is_ok();
        if ok == want {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < EVENTUALLY,
            "`{script}` still {} after {EVENTUALLY:?}; log:\n{}",
            if want { "failing" } else { "succeeding" },
            proxy.tail()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Late state converges: a ServiceCIDR created while the proxy runs (after its first sync)
/// reaches nftables mode's drop of unallocated ClusterIPs at the next sync, and its deletion
/// takes the drop away again.
fn service_cidrs_created_and_deleted_while_running(mode: Mode) {
    let world = World::new(mode);
    let proxy = world.start_proxy();
    let chain = if mode == Mode::Nftables {
        "cluster-ip-filter"
    } else {
        "cluster-ips-check"
    };
    let drop = format!("nft list chain ip kube-proxy {chain} | grep 10.97.0.0/16 | grep -q drop");
    let drop = drop.as_str();
    eventually_sh(&world, drop, false, &proxy);
    let cidr = serde_json::json!({"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
        "metadata": {"name": "late"}, "spec": {"cidrs": ["10.97.0.0/16"]}});
    world.api.apply(cidr).expect("ServiceCIDR");
    let took = eventually_sh(&world, drop, true, &proxy);
    println!("{mode:?}: a ServiceCIDR created while running reached the rules after {took:?}");
    world.api.delete("ServiceCIDR", "late").expect("delete");
    let took = eventually_sh(&world, drop, false, &proxy);
    println!("{mode:?}: its deletion reached the rules after {took:?}");
}

mod iptables {
    use super::*;

    #[test]
    fn odd_objects_lose_only_themselves() {
        super::odd_objects_lose_only_themselves(Mode::Iptables);
    }

    #[test]
    fn proxy_restarts_under_traffic() {
        proxy_restarts(Mode::Iptables);
    }

    #[test]
    fn api_server_stopped_and_killed() {
        api_server_outages(Mode::Iptables, OUTAGE);
    }

    #[test]
    fn rules_removed_by_other_programs_come_back() {
        let removals = heal::iptables_removals(heal::Kernel::IptablesNft, false);
        heal::heals(Mode::Iptables, heal::Kernel::IptablesNft, removals);
    }

    #[test]
    fn rules_removed_by_other_programs_come_back_through_iptables_restore() {
        let removals = heal::iptables_removals(heal::Kernel::IptablesNft, false);
        heal::heals(Mode::IptablesRestore, heal::Kernel::IptablesNft, removals);
    }

    #[test]
    fn rules_removed_by_other_programs_come_back_on_iptables_legacy() {
        let removals = heal::iptables_removals(heal::Kernel::IptablesLegacy, false);
        heal::heals(
            Mode::IptablesRestore,
            heal::Kernel::IptablesLegacy,
            removals,
        );
    }
}

mod userspace {
    use super::*;

    #[test]
    fn capture_rules_removed_by_other_programs_come_back() {
        let removals = heal::iptables_removals(heal::Kernel::IptablesNft, true);
        heal::heals(Mode::Userspace, heal::Kernel::IptablesNft, removals);
    }
}

/// nftables mode as a fresh install runs it (the verdict-free layout): the whole suite.
mod nftables {
    use super::*;

    #[test]
    fn syncs_the_kernel_refuses_turn_the_proxy_unhealthy() {
        refused::syncs_the_kernel_refuses_turn_the_proxy_unhealthy();
    }

    #[test]
    fn odd_objects_lose_only_themselves() {
        super::odd_objects_lose_only_themselves(Mode::Nftables);
    }

    #[test]
    fn proxy_restarts_under_traffic() {
        proxy_restarts(Mode::Nftables);
    }

    #[test]
    fn api_server_stopped_and_killed() {
        api_server_outages(Mode::Nftables, OUTAGE);
    }

    #[test]
    fn service_cidrs_created_and_deleted_while_running_reach_the_rules() {
        super::service_cidrs_created_and_deleted_while_running(Mode::Nftables);
    }

    #[test]
    fn rules_removed_by_other_programs_come_back_after_the_watch_is_lost() {
        heal::heals_after_the_watch_is_lost(Mode::Nftables);
    }

    #[test]
    fn rules_removed_by_other_programs_come_back() {
        heal::heals(
            Mode::Nftables,
            heal::Kernel::Nftables,
            heal::nftables_maps_removals(),
        );
    }

    #[test]
    fn modes_and_layouts_switch_under_traffic() {
        super::modes_switch_under_traffic();
    }
}

/// nftables mode's previous layout (`--nftables-layout=chains`, upstream's shape): a smoke
/// suite; the traffic suite's differential test compares it with the default case by case.
mod nftables_chains {
    use super::*;

    #[test]
    fn proxy_restarts_under_traffic() {
        proxy_restarts(Mode::NftablesChains);
    }

    #[test]
    fn rules_removed_by_other_programs_come_back() {
        heal::heals(
            Mode::NftablesChains,
            heal::Kernel::Nftables,
            heal::nftables_removals(),
        );
    }
}

/// ipvs mode: this machine's kernel has no IPVS, so one boot of the test VM (tools/kp-vm)
/// runs the `#[ignore]`d scenarios below in Debian's kernel, with [`VM_OUTAGE`]s.
mod ipvs {
    use super::*;
    use support::ipvs_vm;

    /// The ignored scenarios below: every one must pass inside the VM.
    const GUEST_TESTS: usize = 3;

    #[test]
    fn ipvs_faults_in_the_vm() {
        let out = ipvs_vm()
            .run_current_exe(&[
                "--ignored",
                "--test-threads=1",
                "--nocapture",
                "faults::ipvs::",
            ])
            .unwrap_or_else(|e| panic!("the IPVS VM did not run: {e}"));
        println!("VM run took {:.1} s", out.elapsed.as_secs_f64());
        out.assert_tests_passed(GUEST_TESTS);
    }

    #[test]
    #[ignore = "runs inside the IPVS VM (ipvs_faults_in_the_vm)"]
    fn proxy_restarts_under_traffic() {
        proxy_restarts(Mode::Ipvs);
    }

    #[test]
    #[ignore = "runs inside the IPVS VM (ipvs_faults_in_the_vm)"]
    fn api_server_stopped_and_killed() {
        api_server_outages(Mode::Ipvs, VM_OUTAGE);
    }

    #[test]
    #[ignore = "runs inside the IPVS VM (ipvs_faults_in_the_vm)"]
    fn rules_removed_by_other_programs_come_back() {
        heal::heals(Mode::Ipvs, heal::Kernel::Ipvs, heal::ipvs_removals());
    }
}
