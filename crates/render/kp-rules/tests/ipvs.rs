//! ipvs mode's pure planner: virtual and real servers, kube-ipvs0 addresses, ipset entries
//! and the iptables rules (snapshots), hostile names, and the ipset diff. The rules and sets
//! are also applied for real inside a throwaway network namespace (the host kernel has
//! ipset and iptables; IPVS itself is tested in the VM, crates/backend/kp-ipvs and kp-dataplane).

use crate::common;

use std::collections::BTreeSet;
use std::fmt::Write as _;

use common::*;
use kp_core::model::{IpFamily, Protocol};
use kp_ipvs::Scheduler;
use kp_rules::iptables::LocalDetector;
use kp_rules::ipvs::ipset::{self, SetKind};
use kp_rules::ipvs::{Desired, IpvsConfig, plan, rules};

fn ipvs_config() -> IpvsConfig {
    IpvsConfig {
        scheduler: Scheduler::Rr,
        node_ips: vec![ip("192.168.0.2"), ip("2001:db8::1")],
        detected_node_ips: Vec::new(),
        local_detector: LocalDetector::Cidrs(vec![net("10.0.0.0/8"), net("fd00:10::/64")]),
        masquerade_all: false,
        masquerade_bit: 14,
        drop_invalid: true,
        random_fully: true,
    }
}

/// The plan as readable text: one block per virtual server, then addresses and set entries.
fn describe(d: &Desired) -> String {
    let mut out = String::new();
    for (key, svc) in &d.services {
        let _ = writeln!(
            out,
            "{key} {} flags={:#x} timeout={} ({})",
            svc.server.scheduler, svc.server.flags, svc.server.timeout, svc.owner
        );
        for rs in &svc.real_servers {
            let _ = writeln!(out, "  -> {}:{} weight {}", rs.address, rs.port, rs.weight);
        }
    }
    let _ = writeln!(out, "kube-ipvs0: {:?}", d.addresses);
    out.push_str(&ipset::restore_input(
        d.family,
        &d.sets,
        &Default::default(),
    ));
    out
}

fn terminating(address: &str, port: u16) -> kp_core::model::Endpoint {
    let mut e = endpoint(address, port, false);
    e.ready = false;
    e.terminating = true;
    e
}

fn mixed_state() -> kp_core::tracker::ProxyState {
    let mut web = cluster_ip("ns1", "web", "http", "172.30.0.41", 80);
    web.node_port = Some(30080);
    web.external_ips = vec![ip("203.0.113.10")];
    let mut lb = cluster_ip("ns2", "lb", "p80", "172.30.0.42", 80);
    lb.load_balancer_ips = vec![ip("198.51.100.20")];
    lb.load_balancer_source_ranges = vec![net("203.0.113.0/25"), net("192.0.2.7/32")];
    lb.external_policy_local = true;
    lb.node_port = Some(30081);
    lb.health_check_node_port = Some(30000);
    let mut dns = cluster_ip("kube-system", "dns", "dns", "172.30.0.10", 53);
    dns.name.protocol = Protocol::Udp;
    let sticky = with_affinity(cluster_ip("ns3", "sticky", "p", "172.30.0.43", 8080), 600);
    let mut sctp = cluster_ip("ns4", "diameter", "d", "172.30.0.44", 3868);
    sctp.name.protocol = Protocol::Sctp;
    sctp.node_port = Some(30868);
    let v6 = cluster_ip("ns5", "six", "p", "fd00:172:30::45", 80);
    state(vec![
        (
            web,
            vec![
                endpoint("10.180.0.1", 8080, true),
                endpoint("10.180.1.1", 8080, false),
                terminating("10.180.2.1", 8080),
            ],
        ),
        (
            lb,
            vec![
                endpoint("10.180.0.2", 80, true),
                endpoint("10.180.1.2", 80, false),
            ],
        ),
        (dns, vec![endpoint("10.180.0.3", 5353, false)]),
        (sticky, vec![endpoint("10.180.0.4", 8080, false)]),
        (sctp, vec![endpoint("10.180.0.5", 3868, false)]),
        (v6, vec![endpoint("fd00:10::5", 8080, false)]),
    ])
}

#[test]
fn plan_ipv4() {
    insta::assert_snapshot!(describe(&plan(
        &mixed_state(),
        IpFamily::V4,
        &ipvs_config()
    )));
}

#[test]
fn plan_ipv6() {
    insta::assert_snapshot!(describe(&plan(
        &mixed_state(),
        IpFamily::V6,
        &ipvs_config()
    )));
}

#[test]
fn rules_ipv4() {
    insta::assert_snapshot!(
        rules::render(IpFamily::V4, &ipvs_config(), &Default::default()).expect("renders")
    );
}

#[test]
fn rules_ipv6_masquerade_all() {
    let config = IpvsConfig {
        masquerade_all: true,
        random_fully: false,
        drop_invalid: false,
        ..ipvs_config()
    };
    insta::assert_snapshot!(
        rules::render(IpFamily::V6, &config, &Default::default()).expect("renders")
    );
}

#[test]
fn terminating_endpoints_drain_with_weight_zero() {
    let d = plan(&mixed_state(), IpFamily::V4, &ipvs_config());
    let web = d
        .services
        .values()
        .find(|s| s.server.key.address == ip("172.30.0.41"))
        .expect("web");
    let weights: Vec<(String, u32)> = web
        .real_servers
        .iter()
        .map(|r| (r.address.to_string(), r.weight))
        .collect();
    assert_eq!(
        weights,
        [
            ("10.180.0.1".into(), 1),
            ("10.180.1.1".into(), 1),
            ("10.180.2.1".into(), 0)
        ]
    );
}

#[test]
fn external_policy_local_uses_only_local_endpoints_outside() {
    let d = plan(&mixed_state(), IpFamily::V4, &ipvs_config());
    let lb_ip = d
        .services
        .values()
        .find(|s| s.server.key.address == ip("198.51.100.20"))
        .expect("lb");
    assert_eq!(lb_ip.real_servers.len(), 1, "only the local endpoint");
    let cluster = d
        .services
        .values()
        .find(|s| s.server.key.address == ip("172.30.0.42"))
        .expect("cluster ip");
    assert_eq!(
        cluster.real_servers.len(),
        2,
        "ClusterIP uses every endpoint"
    );
}

#[test]
fn source_ranges_admitting_the_node_allow_the_lb_ip_as_source() {
    let entries = |node: &str| -> Vec<String> {
        let mut state = mixed_state();
        state.node.addresses = vec![ip(node), ip("2001:db8::1")];
        let d = plan(&state, IpFamily::V4, &ipvs_config());
        // Exactly one of the two: the node is admitted, or its connections are dropped.
        let dropped = rules::render(IpFamily::V4, &ipvs_config(), &d.lb_no_node_access)
            .expect("renders")
            .lines()
            .filter(|l| l.starts_with("-A KUBE-IPVS-OUT-FILTER"))
            .map(str::to_owned)
            .collect::<Vec<_>>();
        let admitted = !d.sets[&SetKind::LoadBalancerSourceIp].is_empty();
        let expected_drop = "-A KUBE-IPVS-OUT-FILTER -s 198.51.100.20 -m ipvs --vaddr 198.51.100.20 \
                             --vproto tcp --vport 80 -j DROP";
        if admitted {
            assert!(dropped.is_empty(), "{dropped:?}");
        } else {
            assert_eq!(dropped, [expected_drop]);
        }
        let fw = &d.sets[&SetKind::LoadBalancerFw];
        assert_eq!(
            fw.iter().collect::<Vec<_>>(),
            ["198.51.100.20,tcp:80"],
            "the LB IP is firewalled either way"
        );
        d.sets[&SetKind::LoadBalancerSourceIp]
            .iter()
            .cloned()
            .collect()
    };
    // 192.0.2.7/32 is one of the ranges: the node's connections (source: the LB IP, local
    // on kube-ipvs0) pass the firewall, as upstream's allowFromNode.
    assert_eq!(entries("192.0.2.7"), ["198.51.100.20,tcp:80,198.51.100.20"]);
    assert_eq!(
        entries("203.0.113.100"),
        ["198.51.100.20,tcp:80,198.51.100.20"]
    );
    // Outside every range: nothing, so the node is dropped like any other source.
    assert!(entries("192.168.0.2").is_empty());
    assert!(entries("203.0.113.200").is_empty());
}

#[test]
fn local_policies_without_local_endpoints_fall_back_to_the_cluster() {
    // Only the remote endpoint is left: upstream's ipvs mode (kubernetes#97081) programs
    // it rather than nothing, for the LB IP and NodePort as for the ClusterIP.
    let mut state = mixed_state();
    for (name, eps) in state.endpoints.iter_mut() {
        if name.service.name == "lb" {
            eps.retain(|e| !e.is_local);
        }
    }
    let d = plan(&state, IpFamily::V4, &ipvs_config());
    for address in ["198.51.100.20", "192.168.0.2", "172.30.0.42"] {
        let servers: Vec<String> = d
            .services
            .values()
            .filter(|s| s.server.key.address == ip(address) && s.owner.name == "lb")
            .flat_map(|s| s.real_servers.iter().map(|r| r.address.to_string()))
            .collect();
        assert_eq!(servers, ["10.180.1.2"], "{address}");
    }
}

#[test]
fn every_scheduler_is_applied_to_every_virtual_server() {
    for s in Scheduler::ALL {
        let config = IpvsConfig {
            scheduler: s,
            ..ipvs_config()
        };
        let d = plan(&mixed_state(), IpFamily::V4, &config);
        assert!(d.services.values().all(|v| v.server.scheduler == s.name()));
    }
}

#[test]
fn hostile_names_never_reach_sets_or_rules() {
    let benign = mixed_state();
    let mut hostile = benign.clone();
    let rename = |s: &str| format!("{s}\"\n-A INPUT -j ACCEPT\ncreate X hash:ip");
    hostile.services = benign
        .services
        .values()
        .map(|svc| {
            let mut svc = svc.clone();
            svc.name.service.name = rename(&svc.name.service.name).into();
            svc.name.port = rename(&svc.name.port).into();
            (svc.name.clone(), svc)
        })
        .collect();
    hostile.endpoints = benign
        .endpoints
        .iter()
        .map(|(name, eps)| {
            let mut name = name.clone();
            name.service.name = rename(&name.service.name).into();
            name.port = rename(&name.port).into();
            (name, eps.clone())
        })
        .collect();
    for family in [IpFamily::V4, IpFamily::V6] {
        let a = plan(&benign, family, &ipvs_config());
        let b = plan(&hostile, family, &ipvs_config());
        assert_eq!(a.sets, b.sets);
        assert_eq!(a.addresses, b.addresses);
        let servers = |d: &Desired| -> Vec<_> {
            d.services
                .values()
                .map(|s| (s.server.clone(), s.real_servers.clone()))
                .collect()
        };
        assert_eq!(servers(&a), servers(&b));
        let text = ipset::restore_input(family, &b.sets, &Default::default());
        assert!(
            !text.contains("INPUT") && !text.contains("create X"),
            "{text}"
        );
    }
}

#[test]
fn ipset_restore_changes_only_the_difference() {
    let d = plan(&mixed_state(), IpFamily::V4, &ipvs_config());
    let first = ipset::restore_input(IpFamily::V4, &d.sets, &Default::default());
    // What `ipset save` prints after `first` was applied, plus one stale entry.
    let mut saved = String::new();
    for line in first.lines() {
        if let Some(rest) = line.strip_prefix("create ") {
            let _ = writeln!(saved, "create {}", rest.trim_end_matches(" -exist"));
        } else if let Some(rest) = line.strip_prefix("add ") {
            let _ = writeln!(saved, "add {}", rest.trim_end_matches(" -exist"));
        }
    }
    saved.push_str("add KUBE-CLUSTER-IP 172.30.0.99,tcp:80\ncreate OTHER hash:ip\n");
    let current = ipset::parse_save(&saved);
    assert!(!current.contains_key("OTHER"), "not kube-proxy's");
    assert_eq!(
        ipset::restore_input(IpFamily::V4, &d.sets, &current),
        "del KUBE-CLUSTER-IP 172.30.0.99,tcp:80 -exist\n"
    );
    let destroy = ipset::destroy_input(&current);
    assert!(destroy.contains("destroy KUBE-CLUSTER-IP\n"));
    assert!(!destroy.contains("OTHER"));
}

#[test]
fn set_names_follow_upstream() {
    assert_eq!(SetKind::ClusterIp.name(IpFamily::V4), "KUBE-CLUSTER-IP");
    assert_eq!(SetKind::ClusterIp.name(IpFamily::V6), "KUBE-6-CLUSTER-IP");
    assert_eq!(
        SetKind::NodePortSctp.name(IpFamily::V4),
        "KUBE-NODE-PORT-SCTP-HASH"
    );
    // ipset names are at most 31 characters.
    for kind in SetKind::ALL {
        assert!(kind.name(IpFamily::V6).len() <= 31, "{kind:?}");
    }
}

/// Whether the kernel checks with ipset and iptables cannot run here (said on stderr; a
/// failure in CI, see `kernel_check_unavailable`).
fn kernel_checks_unavailable() -> bool {
    let reason = netns_unavailable("ipset").or_else(|| netns_unavailable("iptables-restore"));
    if let Some(reason) = &reason {
        eprintln!("skipped: {reason}");
    }
    reason.is_some()
}

#[test]
fn sets_and_rules_apply_in_the_kernel() {
    if kernel_checks_unavailable() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let mut script = String::from("set -e\n");
    for family in [IpFamily::V4, IpFamily::V6] {
        let d = plan(&mixed_state(), family, &ipvs_config());
        let tool = restore_tool(family);
        let files = [
            (
                "sets",
                ipset::restore_input(family, &d.sets, &Default::default()),
            ),
            ("setup", setup_text(&rules::setup())),
            (
                "rules",
                rules::render(family, &ipvs_config(), &Default::default()).expect("renders"),
            ),
        ];
        for (name, text) in files {
            let path = dir.path().join(format!("{name}-{family:?}"));
            std::fs::write(&path, text).expect("write");
            let apply = if name == "sets" {
                "ipset restore".to_owned()
            } else {
                format!("{tool} --noflush")
            };
            let _ = writeln!(
                script,
                "echo '{name} {family:?}' >&2; {apply} < '{}'",
                path.display()
            );
        }
        let _ = writeln!(script, "{}", tool.replace("-restore", "-save"));
    }
    script.push_str("ipset save\n");
    let saved =
        kp_testbed::isolated::script(&script).unwrap_or_else(|e| panic!("kernel refused: {e}"));
    assert!(saved.contains("-A KUBE-SERVICES -m comment --comment \"Kubernetes service lb portal\" -m set --match-set KUBE-LOAD-BALANCER dst,dst -j KUBE-LOAD-BALANCER"), "{saved}");
    assert!(
        saved.contains("-m set --match-set KUBE-6-CLUSTER-IP dst,dst -j ACCEPT"),
        "{saved}"
    );
    // What the kernel holds reads back as exactly the planned entries: the next sync's diff
    // against it is empty.
    let current = ipset::parse_save(&saved);
    for family in [IpFamily::V4, IpFamily::V6] {
        let d = plan(&mixed_state(), family, &ipvs_config());
        assert_eq!(
            ipset::restore_input(family, &d.sets, &current),
            "",
            "{family:?}"
        );
    }
    let entries: BTreeSet<&str> = saved.lines().filter(|l| l.starts_with("add ")).collect();
    assert!(entries.contains("add KUBE-LOAD-BALANCER-SOURCE-CIDR 198.51.100.20,tcp:80,192.0.2.7"));
}

/// The chains and jumps of [`rules::setup`], created one `iptables` run at a time as
/// `ensure_setup` does (`-N` each chain, `-I <from> 1` each jump), for `tool`.
fn setup_commands(tool: &str) -> String {
    let setup = rules::setup();
    let mut script = String::new();
    for (table, chain) in &setup.chains {
        let _ = writeln!(script, "{tool} -t {} -N {chain}", table.as_str());
    }
    for jump in &setup.jumps {
        let _ = writeln!(
            script,
            "{tool} -t {} -I {} 1 {}",
            jump.table.as_str(),
            jump.from,
            jump.spec
        );
    }
    script
}

#[test]
fn one_restore_with_the_jumps_leaves_what_the_runs_one_by_one_leave() {
    if kernel_checks_unavailable() {
        return;
    }
    let d = plan(&mixed_state(), IpFamily::V4, &ipvs_config());
    let dir = tempfile::tempdir().expect("tempdir");
    let sets = dir.path().join("sets");
    std::fs::write(
        &sets,
        ipset::restore_input(IpFamily::V4, &d.sets, &Default::default()),
    )
    .expect("write");
    let text = rules::render(IpFamily::V4, &ipvs_config(), &Default::default()).expect("renders");
    let setup = rules::setup();
    let all: Vec<_> = setup.jumps.iter().collect();
    let files = [
        ("rules", text.clone()),
        ("with-all", rules::with_jumps(&text, &all)),
    ];
    for (name, content) in &files {
        std::fs::write(dir.path().join(name), content).expect("write");
    }
    let path = |name: &str| dir.path().join(name).display().to_string();
    // Other programs' rules in the built-in chains stay where they are, below ours.
    let foreign = "iptables -A INPUT -s 192.0.2.7/32 -j ACCEPT; \
                   iptables -t nat -A PREROUTING -s 192.0.2.7/32 -j RETURN";
    let start = format!("set -e; ipset restore < '{}'; {foreign}", path("sets"));
    let one_by_one = format!(
        "{start}\n{}iptables-restore --noflush < '{}'\niptables-save",
        setup_commands("iptables"),
        path("rules")
    );
    let one_restore = format!(
        "{start}\niptables-restore --noflush < '{}'\niptables-save",
        path("with-all")
    );
    let a =
        kp_testbed::isolated::script(&one_by_one).unwrap_or_else(|e| panic!("kernel refused: {e}"));
    let b = kp_testbed::isolated::script(&one_restore)
        .unwrap_or_else(|e| panic!("kernel refused: {e}"));
    assert_eq!(
        ruleset(&a),
        ruleset(&b),
        "one by one:\n{a}\none restore:\n{b}"
    );
    assert!(b.contains("-A INPUT -s 192.0.2.7/32 -j ACCEPT"), "{b}");

    // One jump missing (another program deleted it): inserted at the top, as `-I 1` does.
    let jump = setup
        .jumps
        .iter()
        .find(|j| j.to == "KUBE-PROXY-FIREWALL" && j.from == "INPUT")
        .expect("INPUT jump");
    std::fs::write(
        dir.path().join("with-one"),
        rules::with_jumps(&text, &[jump]),
    )
    .expect("write");
    let delete = format!("iptables -D INPUT {}", jump.spec);
    let reinsert = format!("iptables -I INPUT 1 {}", jump.spec);
    let base = format!(
        "{start}\niptables-restore --noflush < '{}'\n{delete}",
        path("with-all")
    );
    let by_run = format!("{base}\n{reinsert}\niptables-save");
    let by_restore = format!(
        "{base}\niptables-restore --noflush < '{}'\niptables-save",
        path("with-one")
    );
    let a = kp_testbed::isolated::script(&by_run).unwrap_or_else(|e| panic!("kernel refused: {e}"));
    let b =
        kp_testbed::isolated::script(&by_restore).unwrap_or_else(|e| panic!("kernel refused: {e}"));
    assert_eq!(ruleset(&a), ruleset(&b), "by run:\n{a}\nby restore:\n{b}");
}

/// ipvs mode skips a full sync's restore when `iptables-save` shows its chains as rendered
/// (kp-dataplane's `rules_in_place`): that needs `rules::saved_form` to spell every rendered
/// rule as the save prints it back.
#[test]
fn the_rules_read_back_from_iptables_save_as_rendered() {
    if kernel_checks_unavailable() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let mut script = String::from("set -e\n");
    let mut rendered = Vec::new();
    for family in [IpFamily::V4, IpFamily::V6] {
        let d = plan(&mixed_state(), family, &ipvs_config());
        let sets = dir.path().join(format!("sets-{family:?}"));
        std::fs::write(
            &sets,
            ipset::restore_input(family, &d.sets, &Default::default()),
        )
        .expect("write");
        let text = rules::render(family, &ipvs_config(), &Default::default()).expect("renders");
        let path = dir.path().join(format!("rules-{family:?}"));
        std::fs::write(&path, &text).expect("write");
        let tool = restore_tool(family);
        let _ = writeln!(
            script,
            "ipset restore < '{}'; {tool} --noflush < '{}'",
            sets.display(),
            path.display()
        );
        rendered.push((family, text));
    }
    script.push_str("iptables-save; echo '#6'; ip6tables-save\n");
    let saved =
        kp_testbed::isolated::script(&script).unwrap_or_else(|e| panic!("kernel refused: {e}"));
    let (v4, v6) = saved.split_once("#6").expect("both saves");
    for ((family, text), saved) in rendered.iter().zip([v4, v6]) {
        let saved = ruleset(saved);
        for (key, rules) in ruleset(text) {
            let want: Vec<String> = rules
                .iter()
                .map(|r| rules::saved_form(*family, r))
                .collect();
            assert_eq!(saved.get(&key), Some(&want), "{family:?} {key:?}");
        }
    }
}
