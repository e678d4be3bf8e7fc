//! Self-healing: another program removes the proxy's rules under traffic (a firewalld-style
//! reload, `iptables -t nat -F`, `nft flush ruleset`, one service's chain or map element,
//! `ipvsadm -C`, deleting `kube-ipvs0`, a loop rewriting them every 100 ms for 10 s, 20 s in
//! the test VM), and they must be back, new connections answered, within [`NOTIFIED_BOUND`]
//! where nf_tables notifies and within the canary period plus that margin elsewhere. Each event is logged and counted once; rules other programs
//! keep in their own chains and tables survive the restore. How many new connections failed
//! in each gap is printed, as is the time each restore took.

use super::*;
use kp_config::DEFAULT_CANARY_PERIOD;
use kp_core::foreign::is_log_message;
use kp_core::foreign::{BACKOFF_MAX, CALM};
use kp_core::proxier::WATCH_LOST_LOG;
use kp_dataplane::watch::fault::FAIL_AFTER_ENV;

/// The issue asks for 1 s where nf_tables notifies; this bound adds margin for a loaded
/// 2-core CI machine running a debug build (the measured time is printed).
const NOTIFIED_BOUND: Duration = Duration::from_secs(3);
/// How often the test looks at the kernel while waiting for the rules.
const POLL: Duration = Duration::from_millis(25);
/// How long the fighting loop runs.
const FIGHT: Duration = Duration::from_secs(10);
/// ...and in the test VM, where a restore is a full sync of 1–3 s (emulated tool runs) and the
/// canary finds the next removal up to 2 s later: 10 s there held only three restores at a
/// host load of 7 (one short of the back-off, which starts at the fourth in a row).
const VM_FIGHT: Duration = Duration::from_secs(20);
/// ipvs mode's bound beyond the canary period: the test VM emulates its CPU (0.3–1 s per
/// tool run under load), where a canary check can take a few hundred milliseconds and then
/// rests nine times as long, and a restore is a full sync of a few tool runs (one
/// `iptables-save` per family, `ipset save`, a restore where rules are missing): seen 0.9–3.1 s
/// per full sync, rules back 0.9–6.2 s after the removal (bench/notes/2026-11-28-ipvs-restore-vm.md;
/// 16–35 s before those runs were cut). About three times the slowest, for a loaded CI
/// machine; the measured time is printed.
const VM_CANARY_BOUND: Duration = Duration::from_secs(20);
/// At most this many restores during the fight: more would mean the proxy spins.
const FIGHT_RESTORES: usize = 20;
/// Another program's IPVS virtual server (ipvs mode), on an address the proxy does not
/// manage: no restore may delete it.
const FOREIGN_VS: &str = "192.0.2.9:80";

/// How the proxy's rules are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// iptables on nf_tables (notified).
    IptablesNft,
    /// iptables-legacy (canaries only).
    IptablesLegacy,
    /// nftables mode (notified).
    Nftables,
    /// nftables mode once its watch is lost (canaries only).
    NftablesUnwatched,
    /// ipvs mode in the VM: IPVS, `kube-ipvs0`, ipsets and iptables (canaries only).
    Ipvs,
}

impl Kernel {
    fn iptables(self) -> &'static str {
        match self {
            Kernel::IptablesLegacy => "iptables-legacy",
            // The VM's `iptables`, which the proxy runs too.
            Kernel::Ipvs => "iptables",
            _ => "iptables-nft",
        }
    }

    /// How long a restore may take after the removal.
    fn bound(self) -> Duration {
        match self {
            Kernel::IptablesLegacy | Kernel::NftablesUnwatched => {
                DEFAULT_CANARY_PERIOD + NOTIFIED_BOUND
            }
            Kernel::Ipvs => DEFAULT_CANARY_PERIOD + VM_CANARY_BOUND,
            _ => NOTIFIED_BOUND,
        }
    }

    /// Rules of other programs: a chain of their own with a rule and a jump to it, and
    /// kubelet's canary chain (iptables; in ipvs mode also a virtual server of their own on
    /// an address that is not the proxy's), or a table of their own (nftables). Idempotent.
    fn install_foreign(self) -> String {
        match self {
            Kernel::Nftables | Kernel::NftablesUnwatched => "nft add table inet foreign-keep; \
                nft add chain inet foreign-keep input '{ type filter hook input priority 10; }'; \
                nft list chain inet foreign-keep input | grep -q 192.0.2.7 || \
                nft add rule inet foreign-keep input ip saddr 192.0.2.7 accept"
                .to_owned(),
            Kernel::Ipvs => format!(
                "{}; ipvsadm -Ln -t {FOREIGN_VS} >/dev/null 2>&1 || ipvsadm -A -t {FOREIGN_VS} -s rr",
                iptables_foreign(self.iptables())
            ),
            _ => iptables_foreign(self.iptables()),
        }
    }

    /// Exits 0 when the rules of [`Kernel::install_foreign`] are all there.
    fn foreign_present(self) -> String {
        match self {
            Kernel::Nftables | Kernel::NftablesUnwatched => {
                "nft list chain inet foreign-keep input | grep -q 192.0.2.7".to_owned()
            }
            Kernel::Ipvs => format!(
                "{} && ipvsadm -Ln -t {FOREIGN_VS} >/dev/null",
                iptables_foreign_present(self.iptables())
            ),
            _ => iptables_foreign_present(self.iptables()),
        }
    }
}

/// Another program's chain with a rule and a jump to it, and kubelet's canary chain, written
/// with `ipt`. Idempotent.
fn iptables_foreign(ipt: &str) -> String {
    format!(
        "I={ipt}; $I -t filter -N FOREIGN-KEEP 2>/dev/null; \
         $I -t filter -C FOREIGN-KEEP -s 192.0.2.7/32 -j ACCEPT 2>/dev/null || \
         $I -t filter -A FOREIGN-KEEP -s 192.0.2.7/32 -j ACCEPT; \
         $I -t filter -C INPUT -j FOREIGN-KEEP 2>/dev/null || $I -t filter -I INPUT -j FOREIGN-KEEP; \
         $I -t mangle -N KUBE-KUBELET-CANARY 2>/dev/null; true"
    )
}

/// Exits 0 when the rules of [`iptables_foreign`] are all there.
fn iptables_foreign_present(ipt: &str) -> String {
    format!(
        "I={ipt}; $I -t filter -C FOREIGN-KEEP -s 192.0.2.7/32 -j ACCEPT && \
         $I -t filter -C INPUT -j FOREIGN-KEEP && $I -t mangle -S KUBE-KUBELET-CANARY"
    )
}

/// One way of removing the rules.
pub struct Removal {
    name: &'static str,
    /// Run in the node namespace.
    script: String,
    /// Exits 0 once the removed rules are back.
    restored: String,
    /// The removal leaves other programs' rules alone: they must still be there after.
    keeps_foreign: bool,
    /// How many foreign-change events it is (a reload of six commands may be seen as two if
    /// the machine is slow enough to spread them over the proxy's settle time).
    events: std::ops::RangeInclusive<usize>,
    /// Rewrites in a loop for [`FIGHT`]: the proxy must back off.
    fight: bool,
    /// With `fight`: whether the back-off line must appear (in the emulated VM a restore
    /// takes seconds, so the loop may be seen too few times to start the back-off; the
    /// back-off itself is tested on the host).
    backoff_required: bool,
}

impl Removal {
    /// One event, no fight, found by the short-period check.
    fn new(name: &'static str, script: String, restored: String, keeps_foreign: bool) -> Self {
        Self {
            name,
            script,
            restored,
            keeps_foreign,
            events: 1..=1,
            fight: false,
            backoff_required: true,
        }
    }
}

/// Exits 0 when the steady Service is dispatched again from nat `PREROUTING`.
fn iptables_restored(ipt: &str, capture: bool) -> String {
    let entry = if capture {
        format!("{ipt} -t nat -S PREROUTING | grep -q -- '-j KUBE-'")
    } else {
        format!(
            "{ipt} -t nat -C PREROUTING -m comment --comment 'kubernetes service portals' -j KUBE-SERVICES"
        )
    };
    let filter = if capture {
        String::new()
    } else {
        format!(" && {ipt} -t filter -S INPUT | grep -q -- '-j KUBE-'")
    };
    format!("{entry} && {ipt} -t nat -S | grep -q {STEADY_IP}{filter}")
}

/// The removals for iptables-based modes (`capture`: userspace mode's chains).
pub fn iptables_removals(kernel: Kernel, capture: bool) -> Vec<Removal> {
    let ipt = kernel.iptables();
    let restored = iptables_restored(ipt, capture);
    let one =
        |name, script, keeps_foreign| Removal::new(name, script, restored.clone(), keeps_foreign);
    // On legacy the canary sees nat's size change (one getsockopt) and only then reads it.
    let mut removals = vec![
        one("iptables -t nat -F", format!("{ipt} -t nat -F"), true),
        Removal {
            events: 1..=2,
            ..one(
                "firewalld-style reload (-F, -X in mangle, nat, filter)",
                format!("for t in mangle nat filter; do {ipt} -t $t -F; {ipt} -t $t -X; done"),
                false,
            )
        },
    ];
    if kernel == Kernel::IptablesNft && !capture {
        // One service's chain emptied: only nf_tables tells; legacy's canaries are the jumps.
        let chain = format!(
            "c=$({ipt} -t nat -S KUBE-SERVICES | grep {STEADY_IP} | sed 's/.*-j //' | head -1)"
        );
        removals.push(Removal {
            restored: format!("{chain}; {ipt} -t nat -S $c | grep -q -- ' -j '"),
            ..one(
                "one service's chain flushed",
                format!("{chain}; {ipt} -t nat -F $c"),
                true,
            )
        });
    }
    if kernel == Kernel::IptablesNft {
        removals.push(one(
            "nft flush ruleset",
            "nft flush ruleset".to_owned(),
            false,
        ));
    }
    removals.push(Removal {
        events: 1..=FIGHT_RESTORES,
        fight: true,
        ..one(
            "iptables -t nat -F every 100 ms for 10 s",
            fight_loop(&format!("{ipt} -t nat -F"), FIGHT),
            true,
        )
    });
    removals
}

/// The removals for nftables mode.
pub fn nftables_removals() -> Vec<Removal> {
    table_removals(
        steady_service_listed(Mode::NftablesChains),
        "one service's map element deleted",
        format!("nft delete element ip kube-proxy service-ips '{{ {STEADY_IP} . tcp . 80 }}'"),
    )
}

/// The removals for nftables mode's verdict-free layout: the steady Service (two endpoints)
/// is an element of `slots-2`.
pub fn nftables_maps_removals() -> Vec<Removal> {
    let entry = format!("{STEADY_IP} . tcp . 80");
    table_removals(
        steady_service_listed(Mode::Nftables),
        "one service's set element deleted",
        format!("nft delete element ip kube-proxy slots-2 '{{ {entry} }}'"),
    )
}

/// What both nftables layouts face: the steady Service's element deleted (`element`, by
/// `delete`), the table deleted once and in a loop, the ruleset flushed; `restored` exits 0
/// once the element is back.
fn table_removals(restored: String, element: &'static str, delete: String) -> Vec<Removal> {
    let one = |name, script: &str, keeps_foreign| {
        Removal::new(name, script.to_owned(), restored.clone(), keeps_foreign)
    };
    vec![
        one(element, &delete, true),
        one(
            "nft delete table ip kube-proxy",
            "nft delete table ip kube-proxy",
            true,
        ),
        one("nft flush ruleset", "nft flush ruleset", false),
        Removal {
            events: 1..=FIGHT_RESTORES,
            fight: true,
            ..one(
                "nft delete table ip kube-proxy every 100 ms for 10 s",
                &fight_loop("nft delete table ip kube-proxy 2>/dev/null", FIGHT),
                true,
            )
        },
    ]
}

/// The removals for ipvs mode (in the VM): the canaries are IPVS, `kube-ipvs0` and its
/// addresses, the ipsets and the jumps into ipvs mode's chains. The rewrite loop deletes the
/// steady Service's address from `kube-ipvs0`, which only the canary check finds (the jumps
/// are watched through nf_tables there), and leaves other programs' rules alone.
pub fn ipvs_removals() -> Vec<Removal> {
    let ipt = Kernel::Ipvs.iptables();
    let ipvs_restored = format!("ipvsadm -Ln | grep -q '{STEADY_IP}:80'");
    let address_restored = format!("ip -o addr show dev kube-ipvs0 | grep -q ' {STEADY_IP}/'");
    let one = Removal::new;
    vec![
        one(
            "ipvsadm -C",
            "ipvsadm -C".to_owned(),
            ipvs_restored.clone(),
            false,
        ),
        one(
            "ip link del kube-ipvs0",
            "ip link del kube-ipvs0".to_owned(),
            address_restored.clone(),
            true,
        ),
        Removal {
            events: 1..=2,
            ..one(
                "firewalld-style reload (-F, -X in mangle, nat, filter)",
                format!("for t in mangle nat filter; do {ipt} -t $t -F; {ipt} -t $t -X; done"),
                format!(
                    "{ipt} -t nat -C PREROUTING -m comment --comment 'kubernetes service portals' -j KUBE-SERVICES && \
                     {ipt} -t nat -S KUBE-SERVICES | grep -q KUBE-CLUSTER-IP && \
                     {ipt} -t filter -S INPUT | grep -q -- '-j KUBE-'"
                ),
                false,
            )
        },
        Removal {
            events: 1..=FIGHT_RESTORES,
            fight: true,
            backoff_required: false,
            ..one(
                "kube-ipvs0's service address deleted every 100 ms for 20 s",
                fight_loop(
                    &format!("ip addr del {STEADY_IP}/32 dev kube-ipvs0 2>/dev/null"),
                    VM_FIGHT,
                ),
                address_restored,
                true,
            )
        },
    ]
}

/// `command` every 100 ms for `fight` to a second more (the clock is read in whole seconds:
/// the VM's busybox `date` has no `%N`); prints how many times it ran.
fn fight_loop(command: &str, fight: Duration) -> String {
    format!(
        "start=$(date +%s); n=0; \
         while [ $(( $(date +%s) - start )) -lt {} ]; do {command}; n=$((n+1)); sleep 0.1; done; \
         echo $n",
        fight.as_secs() + 1
    )
}

/// The proxy's log lines that tell how a restore went: the foreign-change line, back-off,
/// checks that found something and full syncs (with their time; ipvs mode's phases too).
fn restore_trace(line: &str) -> bool {
    is_log_message(line)
        || line.contains("backing off")
        || line.contains("ipvs full sync finished")
        || (line.contains(kp_core::proxier::VERIFIED_LOG) && !line.contains("found=\"0\""))
        || (line.contains(kp_testbed::proxy::SYNCED_LOG) && line.contains("kind=\"Full\""))
}

/// Wall-clock time of day (UTC), as the proxy's log lines print it, to read the trace
/// against the removal.
fn time_of_day() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let secs = now.as_secs() % 86_400;
    format!(
        "{:02}:{:02}:{:02}.{:06}",
        secs / 3600,
        secs / 60 % 60,
        secs % 60,
        now.subsec_micros()
    )
}

/// Runs `removals` one after the other against a proxy in `mode` writing through `kernel`.
pub fn heals(mode: Mode, kernel: Kernel, removals: Vec<Removal>) {
    let mut world = World::new(mode);
    if kernel == Kernel::IptablesLegacy {
        world.flags = std::mem::take(&mut world.flags).flag("--iptables-backend=legacy");
    }
    let mut proxy = world.start_proxy();
    for removal in removals {
        heal_one(&world, &mut proxy, kernel, &removal);
    }
}

/// The nf_tables watch fails a second after the start (the test build's fault hook), under
/// traffic: the loss is logged and counted once, and the canary checks take over, so a deleted
/// table is back within the canary period (plus margin), not at the 30 s periodic check.
pub fn heals_after_the_watch_is_lost(mode: Mode) {
    let mut world = World::new(mode);
    world.flags = std::mem::take(&mut world.flags).env(FAIL_AFTER_ENV, "1000");
    let mut proxy = world.start_proxy();
    let lost = proxy.wait_for("the watch lost", |l| l.contains(WATCH_LOST_LOG));
    println!("{mode:?}: {lost}");
    assert!(
        lost.contains(FAIL_AFTER_ENV),
        "the reason is logged: {lost}"
    );
    let cluster = &world.cluster;
    let metrics = http_get_path(cluster, cluster.node(), proxy.metrics_address(), "/metrics");
    let losses = metric_sum(&metrics.body, "kube_proxy_rs_watch_losses_total");
    assert_eq!(losses, Some(1.0), "{}", metrics.body);
    let removal = Removal::new(
        "nft delete table ip kube-proxy, unwatched",
        "nft delete table ip kube-proxy".to_owned(),
        steady_service_listed(mode),
        true,
    );
    heal_one(&world, &mut proxy, Kernel::NftablesUnwatched, &removal);
    assert_eq!(proxy.logged(|l| l.contains(WATCH_LOST_LOG)).len(), 1);
}

/// A script that exits 0 once the steady Service's element is in `mode`'s table.
fn steady_service_listed(mode: Mode) -> String {
    if mode == Mode::NftablesChains {
        format!("nft list map ip kube-proxy service-ips | grep -q {STEADY_IP}")
    } else {
        format!("nft list set ip kube-proxy slots-2 | grep -q '{STEADY_IP} . tcp . 80'")
    }
}

fn sh(world: &World, script: &str) -> Result<String, kp_testbed::TestbedError> {
    world
        .cluster
        .exec(world.cluster.node_ns(), &["sh", "-c", script])
}

/// Waits (bounded by `bound` from `since`) until `restored` exits 0; returns when it did.
fn wait_restored(
    world: &World,
    restored: &str,
    since: Instant,
    bound: Duration,
    what: &str,
    proxy: &Proxy,
) -> Duration {
    loop {
        if sh(world, restored).is_ok() {
            return since.elapsed();
        }
        assert!(
            since.elapsed() < bound,
            "{what}: the rules were not back within {bound:?}; log:\n{}",
            proxy.tail()
        );
        std::thread::sleep(POLL);
    }
}

fn heal_one(world: &World, proxy: &mut Proxy, kernel: Kernel, removal: &Removal) {
    let cluster = &world.cluster;
    let what = format!("{:?}/{kernel:?}: {}", world.mode, removal.name);
    sh(world, &kernel.install_foreign()).unwrap_or_else(|e| panic!("{what}: foreign rules: {e}"));
    let is_foreign = |l: &str| is_log_message(l);
    let is_backoff = |l: &str| l.contains("backing off");
    // Each removal is a new event, not part of the previous one's streak.
    std::thread::sleep(CALM);
    let (logged_before, backoffs_before, traced_before) = (
        proxy.logged(is_foreign).len(),
        proxy.logged(is_backoff).len(),
        proxy.logged(restore_trace).len(),
    );
    let ((removed_for, took), outcomes) = under_load(cluster, || {
        std::thread::sleep(SETTLE);
        let start = Instant::now();
        let out = sh(world, &removal.script).unwrap_or_else(|e| panic!("{what}: {e}"));
        let removed_for = start.elapsed();
        println!("{what}: removal ended at {}", time_of_day());
        if removal.fight {
            println!("{what}: the loop rewrote {} times", out.trim());
        }
        // From the end of the removal (the fight's last rewrite).
        let since = Instant::now();
        let mut bound = kernel.bound();
        if removal.fight {
            bound += BACKOFF_MAX;
        }
        let took = wait_restored(world, &removal.restored, since, bound, &what, proxy);
        let outcome = cluster
            .tcp(cluster.client(), ip(STEADY_IP), 80)
            .expect("probe runs");
        assert!(
            outcome.answered_by("a") || outcome.answered_by("b"),
            "{what}: a new connection right after the restore: {outcome:?}\n{}",
            proxy.tail()
        );
        std::thread::sleep(SETTLE);
        (removed_for, took)
    });
    let failed = outcomes
        .iter()
        .filter(|o| !(o.answered_by("a") || o.answered_by("b")))
        .count();
    println!(
        "{what}: rules back {took:?} after the removal ended (it took {removed_for:?}); \
         {failed} of {} new connections failed during the gap",
        outcomes.len()
    );
    for line in proxy.logged(restore_trace).iter().skip(traced_before) {
        println!("{what}: log: {line}");
    }
    assert!(
        outcomes.len() >= 5,
        "{what}: only {} connections",
        outcomes.len()
    );

    let events = proxy.logged(is_foreign).len() - logged_before;
    assert!(
        removal.events.contains(&events),
        "{what}: {events} foreign-change lines, expected {:?}:\n{:#?}",
        removal.events,
        proxy.logged(is_foreign)
    );
    let backoffs = proxy.logged(is_backoff).len() - backoffs_before;
    let expected_backoffs = match (removal.fight, removal.backoff_required) {
        (false, _) => 0..=0,
        (true, true) => 1..=1,
        (true, false) => 0..=1,
    };
    assert!(
        expected_backoffs.contains(&backoffs),
        "{what}: {backoffs} backing-off lines, expected {expected_backoffs:?}\n{}",
        proxy.tail()
    );
    let metrics = http_get_path(cluster, cluster.node(), proxy.metrics_address(), "/metrics");
    let counted = metric_sum(&metrics.body, "kube_proxy_rs_foreign_changes_total").unwrap_or(0.0);
    let logged_total = proxy.logged(is_foreign).len();
    let logged_total = f64::from(u32::try_from(logged_total).expect("few lines"));
    assert_eq!(
        counted, logged_total,
        "{what}: counted as logged\n{}",
        metrics.body
    );
    println!(
        "{what}: {events} event(s) logged and counted, e.g. {:?}",
        proxy.logged(is_foreign).last()
    );
    if removal.keeps_foreign {
        sh(world, &kernel.foreign_present())
            .unwrap_or_else(|e| panic!("{what}: other programs' rules did not survive: {e}"));
    }
}
