//! The generator produces valid manifests of the promised shape, edits change exactly one
//! service, the log parser reads the proxy's lines, and the splitter keeps every rule in a
//! valid order. No timings are checked anywhere.

use std::collections::BTreeSet;
use std::time::Duration;

use kp_core::backend::SyncKind;
use kp_core::model::{IpFamily, Protocol, ServiceName};
use kp_rules::iptables::{RenderConfig, SyncScope, render};

use crate::generate::{self, Edit, Scale};
use crate::logs::{LogLine, SyncCollector, parse_duration};
use crate::report::{Figure, Table, human};
use crate::split::split_restore;
use crate::state::{Loaded, parse_file};

fn name(index: usize) -> ServiceName {
    ServiceName {
        namespace: generate::namespace(index).into(),
        name: generate::service_name(index).into(),
    }
}

#[test]
fn generated_manifests_parse_cleanly_with_the_promised_shape() {
    let scale = Scale::new(1203, 3);
    let manifests = generate::generate(scale);
    assert_eq!(manifests.files.len(), scale.files() + 1);
    assert_eq!(manifests.files[0].0, "node.yaml");
    assert!(scale.files() > 1, "several files");

    let loaded = Loaded::new(&manifests).expect("valid manifests");
    let state = &loaded.state;
    assert_eq!(state.service_count(), 1203);
    assert_eq!(state.services.len(), scale.service_ports());
    assert_eq!(loaded.endpoints(), scale.service_ports() * 3);
    assert_eq!(state.node.name, generate::NODE_NAME);

    let udp = state
        .services
        .keys()
        .filter(|p| p.protocol == Protocol::Udp)
        .count();
    assert_eq!(udp, (0..1203).filter(|i| generate::is_udp(*i)).count());

    let node_ports: Vec<u16> = state
        .services
        .values()
        .filter_map(|p| p.node_port)
        .collect();
    assert_eq!(node_ports.len(), scale.node_ports());
    let unique: BTreeSet<u16> = node_ports.iter().copied().collect();
    assert_eq!(unique.len(), node_ports.len(), "NodePorts are unique");
    assert!(node_ports.iter().all(|p| *p >= 30000));

    let cluster_ips: BTreeSet<_> = state
        .services
        .values()
        .filter_map(|p| p.cluster_ips.first().copied())
        .collect();
    assert_eq!(cluster_ips.len(), 1203, "one ClusterIP per service");

    let endpoint_ips: BTreeSet<_> = state.endpoints.values().flatten().map(|e| e.ip).collect();
    assert_eq!(
        endpoint_ips.len(),
        1203 * 3,
        "endpoint addresses are unique"
    );
    let local = state
        .endpoints
        .values()
        .flatten()
        .filter(|e| e.is_local)
        .count();
    assert!(local > 0, "some endpoints are on this node");
}

#[test]
fn each_service_lives_in_the_file_the_scale_names() {
    let scale = Scale::new(1203, 2);
    let manifests = generate::generate(scale);
    for index in [0, 500, 1202] {
        let (file, text) = &manifests.files[scale.file_of(index) + 1];
        assert_eq!(file, &generate::file_name(scale.file_of(index)));
        let objects = parse_file(file, text).expect("valid");
        let wanted = generate::service_name(index);
        assert!(
            objects.iter().any(|o| o.key().name == wanted),
            "{wanted} in {file}"
        );
    }
}

#[test]
fn an_edit_changes_exactly_one_service_and_keeps_earlier_edits() {
    let scale = Scale::new(40, 4);
    let mut loaded = Loaded::new(&generate::generate(scale)).expect("valid");
    let first = [Edit::replace(0, 1)];
    let (file, text) = generate::edited_file(scale, &first).expect("edit");
    assert_eq!(file, generate::file_name(0));
    let changed = loaded.update(&file, &text).expect("valid edit");
    assert_eq!(changed, BTreeSet::from([name(0)]));

    let both = [first[0], Edit::replace(9, 1)];
    let (file, text) = generate::edited_file(scale, &both).expect("edit");
    let changed = loaded.update(&file, &text).expect("valid edit");
    assert_eq!(changed, BTreeSet::from([name(9)]));
    assert_eq!(loaded.endpoints(), scale.service_ports() * 4);
}

#[test]
fn services_without_endpoints_are_valid_and_an_edit_adds_one() {
    let scale = Scale::new(12, 0);
    let mut loaded = Loaded::new(&generate::generate(scale)).expect("valid");
    assert_eq!(loaded.endpoints(), 0);
    let edit = [Edit::replace(3, 1)];
    let (file, text) = generate::edited_file(scale, &edit).expect("edit");
    let changed = loaded.update(&file, &text).expect("valid edit");
    assert_eq!(changed, BTreeSet::from([name(3)]));
    assert!(loaded.endpoints() > 0);
}

#[test]
fn durations_in_debug_format_parse() {
    assert_eq!(parse_duration("8.5s"), Some(Duration::from_millis(8500)));
    assert_eq!(
        parse_duration("12.25ms"),
        Some(Duration::from_micros(12250))
    );
    assert_eq!(parse_duration("950µs"), Some(Duration::from_micros(950)));
    assert_eq!(parse_duration("3ns"), Some(Duration::from_nanos(3)));
    assert_eq!(parse_duration("0ns"), Some(Duration::ZERO));
    assert_eq!(parse_duration("fast"), None);
    assert_eq!(parse_duration("-1s"), None);
}

#[test]
fn klog_lines_parse_into_message_and_fields() {
    let line = r#"I1122 06:20:01.123456   12345 proxier.rs:423] synced proxy rules reason="Some(\"x y\")" kind="Full" changed="0" apply="1.5ms" backend="8.25s" rules="43000""#;
    let parsed = LogLine::parse(line).expect("klog line");
    assert_eq!(parsed.severity, 'I');
    assert_eq!(parsed.source, "proxier.rs:423");
    assert_eq!(parsed.message, "synced proxy rules");
    assert_eq!(parsed.field("reason"), Some(r#"Some("x y")"#));
    assert_eq!(parsed.field("kind"), Some("Full"));
    assert_eq!(
        parsed.duration("backend"),
        Some(Duration::from_millis(8250))
    );
    assert_eq!(parsed.number("rules"), Some(43000));

    let bare = LogLine::parse("W1122 06:20:01.123456 1 x.rs:1] no fields here").expect("line");
    assert_eq!(bare.message, "no fields here");
    assert!(bare.fields.is_empty());
    assert_eq!(LogLine::parse("not a klog line"), None);
}

#[test]
fn the_collector_groups_phase_lines_into_syncs() {
    let log = [
        r#"I1122 06:20:00.000001 1 mod.rs:1] prepared iptables full sync family="V4" setup="20ms" save="5ms""#,
        r#"I1122 06:20:00.000002 1 mod.rs:2] rendered iptables rules family="V4" kind="Full" render="100ms" bytes="1000" rules_written="400""#,
        r#"I1122 06:20:00.000003 1 mod.rs:3] applied iptables rules family="V4" kind="Full" restore="2s" rules_written="400""#,
        r#"I1122 06:20:00.000004 1 mod.rs:1] prepared iptables full sync family="V6" setup="10ms" save="5ms""#,
        r#"I1122 06:20:00.000005 1 mod.rs:2] rendered iptables rules family="V6" kind="Full" render="1ms" bytes="100" rules_written="10""#,
        r#"I1122 06:20:00.000006 1 mod.rs:3] applied iptables rules family="V6" kind="Full" restore="50ms" rules_written="10""#,
        r#"I1122 06:20:00.000007 1 mod.rs:4] iptables sync finished full="true" rules_written="410" took="2.3s""#,
        r#"I1122 06:20:00.000008 1 proxier.rs:5] synced proxy rules kind="Full" changed="0" apply="10ms" backend="2.3s" rules="410""#,
        r#"I1122 06:20:00.000009 1 proxier.rs:6] first sync of proxy rules complete services="10" took="2.31s" since_start="2.5s""#,
        r#"I1122 06:20:01.000000 1 mod.rs:2] rendered iptables rules family="V4" kind="Partial" render="1ms" bytes="100" rules_written="12""#,
    ];
    let mut collector = SyncCollector::default();
    for line in log {
        collector.feed(&LogLine::parse(line).expect("line"));
    }
    assert_eq!(collector.completed.len(), 1);
    let sync = &collector.completed[0];
    assert_eq!(sync.kind, "Full");
    assert_eq!(sync.families.len(), 2);
    assert_eq!(sync.render(), Some(Duration::from_millis(101)));
    assert_eq!(sync.restore(), Some(Duration::from_millis(2050)));
    assert_eq!(sync.setup, Some(Duration::from_millis(30)));
    assert_eq!(sync.total(), Some(Duration::from_millis(2310)));
    assert_eq!(sync.rules, Some(410));
    assert_eq!(sync.changed, Some(0));
    assert_eq!(
        collector.first_sync,
        Some((
            Some(Duration::from_millis(2310)),
            Some(Duration::from_millis(2500))
        ))
    );
    let progress = collector.in_progress();
    assert_eq!(progress.kind, "Partial");
    assert_eq!(progress.restore(), None);
}

fn rendered(services: usize) -> String {
    let loaded = Loaded::new(&generate::generate(Scale::new(services, 3))).expect("valid");
    let (services, chains) = (BTreeSet::new(), BTreeSet::new());
    render(
        &loaded.state,
        IpFamily::V4,
        &RenderConfig::default(),
        &SyncScope {
            kind: SyncKind::Full,
            changed: &services,
            existing_chains: &chains,
        },
    )
    .expect("renders")
    .text
}

#[test]
fn split_parts_keep_every_line_and_declare_targets_first() {
    let text = rendered(60);
    let parts = split_restore(&text, 4);
    assert!(parts.len() > 1 && parts.len() <= 4, "{} parts", parts.len());

    let original: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("-A ") || l.starts_with(':'))
        .collect();
    let mut split: Vec<&str> = parts
        .iter()
        .flat_map(|p| p.lines())
        .filter(|l| l.starts_with("-A ") || l.starts_with(':'))
        .collect();
    let mut sorted = original.clone();
    sorted.sort_unstable();
    split.sort_unstable();
    assert_eq!(split, sorted, "every declaration and rule exactly once");

    // Within each chain the rules keep their order.
    let chain_rules = |t: &str, chain: &str| -> Vec<String> {
        t.lines()
            .filter(|l| l.starts_with(&format!("-A {chain} ")))
            .map(str::to_owned)
            .collect()
    };
    let joined = parts.concat();
    assert_eq!(
        chain_rules(&text, "KUBE-SERVICES"),
        chain_rules(&joined, "KUBE-SERVICES")
    );

    // Every jump to a nat chain of ours goes to one declared in this part or before (each
    // part declares its chains before its rules).
    let mut declared: BTreeSet<String> = BTreeSet::new();
    for (i, part) in parts.iter().enumerate() {
        assert_eq!(
            part.starts_with("*filter"),
            i == 0,
            "filter in the first part"
        );
        assert!(part.trim_end().ends_with("COMMIT"));
        let mut in_nat = false;
        for line in part.lines() {
            if let Some(table) = line.strip_prefix('*') {
                in_nat = table == "nat";
            } else if !in_nat {
                continue;
            } else if let Some(decl) = line.strip_prefix(':') {
                declared.insert(decl.split(' ').next().unwrap_or_default().to_owned());
            } else if line.starts_with("-A ") {
                let mut words = line.split(' ');
                while let Some(w) = words.next() {
                    if w == "-j"
                        && let Some(target) = words.next()
                        && target.starts_with("KUBE-")
                    {
                        assert!(
                            declared.contains(target),
                            "part {i}: {target} not declared yet"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn one_part_is_the_whole_ruleset() {
    let text = rendered(10);
    let parts = split_restore(&text, 1);
    assert_eq!(parts.len(), 1);
    let mut a: Vec<&str> = text.lines().collect();
    let mut b: Vec<&str> = parts[0].lines().collect();
    a.sort_unstable();
    b.sort_unstable();
    assert_eq!(a, b);
}

#[test]
fn tables_render_as_markdown() {
    let mut table = Table::new(&["a", "b|c"]);
    table.row(vec!["1".to_owned()]);
    table.row(vec![
        human(Duration::from_millis(1500)),
        Figure::DidNotFinish(Duration::from_secs(600)).to_string(),
    ]);
    assert_eq!(
        table.render(),
        "| a | b\\|c |\n| --- | --- |\n| 1 | - |\n| 1.50 s | did not finish in 600 s |\n"
    );
    assert_eq!(human(Duration::from_micros(12_345)), "12.3 ms");
    assert_eq!(Figure::None.to_string(), "-");
}

#[test]
fn connect_stats_round_trip_and_percentiles() {
    use crate::connect::Stats;
    use std::time::Duration;
    let mut samples: Vec<Duration> = (1..=100).rev().map(Duration::from_micros).collect();
    let stats = Stats::of(&mut samples).expect("non-empty");
    assert_eq!(stats.count, 100);
    assert_eq!(stats.p50, Duration::from_micros(50));
    assert_eq!(stats.p99, Duration::from_micros(99));
    assert_eq!(stats.min, Duration::from_micros(1));
    assert_eq!(stats.max, Duration::from_micros(100));
    assert_eq!(Stats::from_line(&stats.to_line()), Some(stats));
    assert_eq!(Stats::of(&mut []), None);
}

#[test]
fn connect_manifests_add_the_target_service() {
    use crate::connect::{TARGET_IP, manifests};
    let one = manifests(1, 10, std::net::Ipv4Addr::new(10, 200, 2, 2));
    // node.yaml and target.yaml only: no generated services.
    assert_eq!(one.files.len(), 2);
    let (name, text) = one.files.last().expect("target file");
    assert_eq!(name, "target.yaml");
    assert!(text.contains(&format!("clusterIP: {TARGET_IP}")));
    assert!(text.contains("addresses: [10.200.2.2]"));
    let many = manifests(1000, 10, std::net::Ipv4Addr::new(10, 200, 2, 2));
    let services: usize = many
        .files
        .iter()
        .map(|(_, t)| t.matches("kind: Service\n").count())
        .sum();
    assert_eq!(services, 1000);
}

#[test]
fn nftables_phase_lines_are_collected() {
    use crate::logs::{LogLine, SyncCollector};
    let mut collector = SyncCollector::default();
    for line in [
        r#"I1122 07:28:40.000000    1 nftables.rs:255] applied nftables transaction family="V4" kind="Full" took="1.35s" render="120ms" bytes="9000" operations="55896""#,
        r#"I1122 07:28:40.000000    1 nftables.rs:378] nftables sync finished full="true" operations="55987" took="1.49s""#,
        r#"I1122 07:28:40.000000    1 proxier.rs:1] synced proxy rules kind="Full" apply="11ms" backend="1.54s" rules="55987" changed="1000""#,
    ] {
        collector.feed(&LogLine::parse(line).expect("parses"));
    }
    let sync = &collector.completed[0];
    assert_eq!(sync.kind, "Full");
    assert_eq!(sync.restore(), Some(std::time::Duration::from_millis(1350)));
    assert_eq!(sync.render(), Some(std::time::Duration::from_millis(120)));
    assert_eq!(sync.families[0].bytes, Some(9000));
    assert_eq!(
        sync.backend_total,
        Some(std::time::Duration::from_millis(1490))
    );
}

#[test]
fn the_single_file_layout_holds_the_same_objects_and_edits_one_service() {
    let scale = Scale::new(1203, 2);
    let files = Loaded::new(&generate::generate(scale)).expect("valid");
    let mut single = Loaded::new(&generate::generate_single(scale)).expect("valid");
    assert_eq!(
        generate::generate_single(scale).files.len(),
        2,
        "node.yaml + one file"
    );
    assert_eq!(single.state, files.state);
    let edit = [Edit::replace(700, 1)];
    let (file, text) = generate::edited_single(scale, &edit);
    assert_eq!(file, generate::SINGLE_FILE);
    let changed = single.update(&file, &text).expect("valid edit");
    assert_eq!(changed, BTreeSet::from([name(700)]));
}

#[test]
fn every_change_kind_changes_its_service_alone_and_stays_valid() {
    use clap::ValueEnum as _;
    let scale = Scale::new(40, 3);
    let mut loaded = Loaded::new(&generate::generate(scale)).expect("valid");
    let mut edits: Vec<Edit> = Vec::new();
    for &change in generate::Change::value_variants() {
        let edit = generate::next_edit(scale, change, &edits).expect("a service fits");
        edits.push(edit);
        let home = generate::file_name(scale.file_of(edit.service).min(scale.files() - 1));
        let (file, text) =
            generate::edited_file(scale, &edits_in(&edits, scale, &home)).expect("an edited file");
        if change == generate::Change::ServiceRemoved {
            let gone = format!("name: {}\n", generate::service_name(edit.service));
            assert!(!text.contains(&gone), "{change:?}: {gone} still there");
            continue;
        }
        let changed = loaded.update(&file, &text).expect("valid edit");
        assert_eq!(changed, BTreeSet::from([name(edit.service)]), "{change:?}");
        // The API server's view of the same edit is valid on its own.
        let (service, slice) = generate::objects_yaml(scale, edit.service, &edits);
        parse_file("edit.yaml", &format!("{service}{slice}")).expect("valid objects");
    }
    // Every file with every edit is a valid cluster.
    let files = (0..scale.files())
        .map(|f| {
            let name = generate::file_name(f);
            let text = generate::edited_file(scale, &edits_in(&edits, scale, &name))
                .map_or_else(String::new, |(_, text)| text);
            (name, text)
        })
        .collect();
    Loaded::new(&generate::Manifests { files }).expect("every edit together is valid");
}

/// The edits whose service lives in `file` (new services live in the last file).
fn edits_in(edits: &[Edit], scale: Scale, file: &str) -> Vec<Edit> {
    edits
        .iter()
        .copied()
        .filter(|e| {
            let index = scale.file_of(e.service).min(scale.files() - 1);
            generate::file_name(index) == file
        })
        .collect()
}
