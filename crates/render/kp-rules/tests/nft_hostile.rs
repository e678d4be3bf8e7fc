//! Names from API objects cannot inject into the nft script: they only appear in
//! identifiers (characters outside `[A-Za-z0-9_./-]` replaced) and in percent-encoded
//! comments. Every hostile variant must produce exactly the statements a benign name does,
//! and the real `nft` must apply it without touching anything outside our table.

use crate::common;
use crate::nft_common;

use std::collections::BTreeSet;

use common::{cluster_ip, endpoint, ip, net, state, with_affinity};
use kp_core::model::{Endpoint, IpFamily, ServicePort};
use kp_core::tracker::ProxyState;
use nft_common::*;

const HOSTILE: [&str; 12] = [
    "a\" ; flush ruleset",
    "x\nadd table ip evil\n",
    "y\r\ndelete table ip sentinel",
    "$var",
    "# comment",
    "{ } ; @set * \\ '",
    "\" } ; add rule ip kube-proxy services accept ; #",
    "名前",
    "",
    "%22%0A",
    "\0\t\u{7f}",
    "nnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn\
     nnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn\
     nnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn\"",
];

/// Services using every feature that writes a name somewhere, named after `text` (in the
/// namespace, the name and the port name).
fn services(text: &str, family: IpFamily) -> Vec<(ServicePort, Vec<Endpoint>)> {
    let v6 = family == IpFamily::V6;
    let pick = |v4: &str, v6_ip: &str| if v6 { v6_ip.to_owned() } else { v4.to_owned() };
    let mut lb = with_affinity(
        cluster_ip(text, text, text, &pick("172.30.0.41", "fd00:10:96::41"), 80),
        60,
    );
    lb.node_port = Some(3001);
    lb.external_ips = vec![ip(&pick("192.168.99.22", "2001:db8:99::22"))];
    lb.load_balancer_ips = vec![ip(&pick("1.2.3.4", "2001:db8:ff::4"))];
    lb.load_balancer_source_ranges = vec![net(&pick("203.0.113.0/25", "2600:5200::/32"))];
    lb.external_policy_local = true;
    let mut empty = cluster_ip(
        text,
        "empty",
        text,
        &pick("172.30.0.42", "fd00:10:96::42"),
        81,
    );
    empty.node_port = Some(3002);
    vec![
        (
            lb,
            vec![
                endpoint(&pick("10.180.0.1", "fd00:10::1"), 8080, false),
                endpoint(&pick("10.180.0.2", "fd00:10::2"), 8080, true),
            ],
        ),
        (empty, vec![]),
    ]
}

fn hostile_state(text: &str, family: IpFamily) -> ProxyState {
    state(services(text, family))
}

#[test]
fn hostile_names_add_no_statements() {
    for family in [IpFamily::V4, IpFamily::V6] {
        let benign = full(&hostile_state("benign", family), family, &nft_config());
        for text in HOSTILE {
            let out = full(&hostile_state(text, family), family, &nft_config());
            check_structure(&out.script(), family);
            assert_eq!(
                out.operations, benign.operations,
                "{text:?} changed the statement count"
            );
            assert_eq!(out.script().lines().count(), out.operations);
            for line in out.script().lines() {
                // Identifiers and comments only ever hold these characters.
                assert!(
                    line.chars().all(|c| c.is_ascii_graphic() || c == ' '),
                    "{line:?}"
                );
                // Outside quoted comments, the text stays in identifiers.
                let bare: String = line.split('"').step_by(2).collect();
                assert!(!bare.contains("flush ruleset"), "{line:?}");
            }
        }
    }
}

#[test]
fn nft_applies_hostile_names_without_side_effects() {
    let Some(reason) = nft_unavailable() else {
        for family in [IpFamily::V4, IpFamily::V6] {
            let mut scripts = vec!["add table ip sentinel\n".to_owned()];
            let mut existing = kp_rules::nftables::NftState::default();
            let mut previous: Option<ProxyState> = None;
            for text in HOSTILE {
                let now = hostile_state(text, family);
                // Alternate full and partial syncs so both paths see every name, and each
                // partial sync also removes the previous hostile services.
                let out = match previous {
                    Some(_) if scripts.len() % 2 == 0 => {
                        let changed: BTreeSet<_> =
                            now.services.keys().map(|n| n.service.clone()).collect();
                        partial(&now, family, &nft_config(), &changed, &existing, true)
                    }
                    _ => render_with(
                        &now,
                        family,
                        &nft_config(),
                        kp_core::backend::SyncKind::Full,
                        &BTreeSet::new(),
                        &existing,
                        true,
                    ),
                };
                existing = out.state_after(&existing);
                scripts.push(out.script());
                previous = Some(now);
            }
            let refs: Vec<&str> = scripts.iter().map(String::as_str).collect();
            let listing = apply_in_netns_then(&refs, "nft list tables; nft list ruleset")
                .unwrap_or_else(|e| panic!("nft rejected a hostile name ({family:?}): {e}"));
            assert!(listing.contains("table ip sentinel"), "{listing}");
            assert!(!listing.contains("evil"), "{listing}");
            let ours = match family {
                IpFamily::V4 => "table ip kube-proxy",
                IpFamily::V6 => "table ip6 kube-proxy",
            };
            assert!(listing.contains(ours), "{listing}");
            // The last hostile name is visible, encoded, in an element comment.
            assert!(listing.contains("comment \"nnnnnnnn"), "{listing}");
        }
        return;
    };
    eprintln!("skipping kernel check: {reason}");
}
