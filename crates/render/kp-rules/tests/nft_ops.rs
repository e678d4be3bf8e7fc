//! Incremental syncs: operations per transaction for upstream's `TestSyncProxyRulesRepeated`
//! sequence, stale-chain handling, self-healing partial syncs, restarts over an existing
//! table. The whole sequence is also applied to a real table in a throwaway network
//! namespace, and the result compared with a fresh full render of the final state.

use crate::common;
use crate::nft_common;

use std::collections::BTreeSet;

use common::{cluster_ip, endpoint, service_name, state, with_affinity};
use kp_core::backend::SyncKind;
use kp_core::model::{Endpoint, IpFamily, ServiceName, ServicePort};
use kp_core::tracker::ProxyState;
use kp_rules::nftables::{ElementSet, NftOutput, NftState};
use nft_common::*;

fn changed(names: &[(&str, &str)]) -> BTreeSet<ServiceName> {
    names.iter().map(|(ns, n)| service_name(ns, n)).collect()
}

/// Records every script of a sequence, to replay it in a namespace at the end.
struct Sequence {
    family: IpFamily,
    scripts: Vec<String>,
    state: NftState,
}

impl Sequence {
    fn start(state: &ProxyState) -> Self {
        let out = full(state, IpFamily::V4, &nft_config());
        Self {
            family: IpFamily::V4,
            state: out.state_after(&NftState::default()),
            scripts: vec![out.script()],
        }
    }

    fn sync(
        &mut self,
        state: &ProxyState,
        changed: &BTreeSet<ServiceName>,
        delete_stale: bool,
    ) -> NftOutput {
        let out = partial(
            state,
            self.family,
            &nft_config(),
            changed,
            &self.state,
            delete_stale,
        );
        assert_eq!(out.kind, SyncKind::Partial);
        check_structure(&out.script(), self.family);
        self.scripts.push(out.script().clone());
        self.state = out.state_after(&self.state);
        out
    }

    /// Applies every script in one namespace and compares the table with a fresh full
    /// render of `last` (after deleting what is pending, which the fresh one never had).
    fn verify_in_kernel(mut self, last: &ProxyState) {
        let cleanup = self.sync(last, &BTreeSet::new(), true);
        assert_eq!(cleanup.operations, cleanup.deleted_chains.len());
        let Some(reason) = nft_unavailable() else {
            let scripts: Vec<&str> = self.scripts.iter().map(String::as_str).collect();
            let incremental = apply_in_netns(self.family, &scripts)
                .unwrap_or_else(|e| panic!("nft rejected the sequence: {e}"));
            let fresh = full(last, self.family, &nft_config());
            let fresh = apply_in_netns(self.family, &[&fresh.script()])
                .unwrap_or_else(|e| panic!("nft rejected the fresh render: {e}"));
            assert!(fresh.contains("\tchain services {"), "{fresh}");
            assert_eq!(normalize_listing(&incremental), normalize_listing(&fresh));
            return;
        };
        eprintln!("skipping kernel replay: {reason}");
    }
}

type Services = Vec<(ServicePort, Vec<Endpoint>)>;

fn svc1() -> (ServicePort, Vec<Endpoint>) {
    (
        cluster_ip("ns1", "svc1", "p80", "172.30.0.41", 80),
        vec![endpoint("10.0.1.1", 80, false)],
    )
}

fn svc2() -> (ServicePort, Vec<Endpoint>) {
    (
        cluster_ip("ns2", "svc2", "p8080", "172.30.0.42", 8080),
        vec![endpoint("10.0.2.1", 8080, false)],
    )
}

fn svc3(endpoints: &[&str]) -> (ServicePort, Vec<Endpoint>) {
    (
        cluster_ip("ns3", "svc3", "p80", "172.30.0.43", 80),
        endpoints.iter().map(|ip| endpoint(ip, 80, false)).collect(),
    )
}

fn svc4(endpoints: &[&str]) -> (ServicePort, Vec<Endpoint>) {
    (
        cluster_ip("ns4", "svc4", "p80", "172.30.0.44", 80),
        endpoints.iter().map(|ip| endpoint(ip, 80, false)).collect(),
    )
}

#[test]
fn upstream_repeated_sync_operation_counts() {
    let initial: Services = vec![svc1(), svc2()];
    let mut seq = Sequence::start(&state(initial));

    // A new service with one endpoint: 2 elements (cluster-ips, service-ips) and 2 new
    // chains with 2 rules each: 8. Upstream's 10 also flushes the new (empty) chains; we know
    // they are not in the table yet.
    let s = state(vec![svc1(), svc2(), svc3(&["10.0.3.1"])]);
    let out = seq.sync(&s, &changed(&[("ns3", "svc3")]), false);
    assert_eq!(out.operations, 8, "{}", out.script());
    assert!(!out.script().contains("flush chain"), "{}", out.script());
    assert_eq!(out.services_written, 1);

    // Deleting a service: 2 element deletions, 2 chain flushes: 4. The chains are only
    // pending deletion.
    let s = state(vec![svc1(), svc3(&["10.0.3.1"])]);
    let out = seq.sync(&s, &changed(&[("ns2", "svc2")]), false);
    assert_eq!(out.operations, 4, "{}", out.script());
    assert_eq!(out.flushed_stale.len(), 2);
    assert!(out.script().lines().all(|l| !l.starts_with("delete chain")));
    assert_eq!(seq.state.pending_deletions().len(), 2);

    // Idle: nothing at all. Upstream deletes stale chains in a separate transaction; here
    // that is the same kind of sync with `delete_stale`, and holds only the deletions.
    let out = seq.sync(&s, &BTreeSet::new(), false);
    assert_eq!(out.operations, 0);
    assert!(out.script().is_empty());
    let out = seq.sync(&s, &BTreeSet::new(), true);
    assert_eq!(out.operations, 2, "{}", out.script());
    assert_eq!(out.deleted_chains.len(), 2);
    assert!(seq.state.pending_deletions().is_empty());

    // A service without endpoints: cluster-ips and no-endpoint-services: 2.
    let s = state(vec![svc1(), svc3(&["10.0.3.1"]), svc4(&[])]);
    let out = seq.sync(&s, &changed(&[("ns4", "svc4")]), false);
    assert_eq!(out.operations, 2, "{}", out.script());
    assert!(out.script().contains("goto reject-chain"));

    // Its endpoint arrives: one element swapped between maps, 2 new chains written: 8
    // (upstream: 10, with the flushes of the new chains).
    let s = state(vec![svc1(), svc3(&["10.0.3.1"]), svc4(&["10.0.4.1"])]);
    let out = seq.sync(&s, &changed(&[("ns4", "svc4")]), false);
    assert_eq!(out.operations, 8, "{}", out.script());

    // An endpoint changes address: service chain rewritten (add, flush, 2 rules), new
    // endpoint chain written (add, 2 rules), old endpoint chain flushed: 8.
    let s = state(vec![svc1(), svc3(&["10.0.3.2"]), svc4(&["10.0.4.1"])]);
    let out = seq.sync(&s, &changed(&[("ns3", "svc3")]), false);
    assert_eq!(out.operations, 8, "{}", out.script());

    // A second endpoint: the service chain (add, flush, masquerade and 2 balancing rules
    // where upstream has one vmap rule), the old endpoint chain (4), the new one (3): 12, as
    // upstream.
    let s = state(vec![
        svc1(),
        svc3(&["10.0.3.2", "10.0.3.3"]),
        svc4(&["10.0.4.1"]),
    ]);
    let out = seq.sync(&s, &changed(&[("ns3", "svc3")]), true);
    assert_eq!(
        out.operations,
        12 + 1,
        "plus the deletion of the old endpoint chain"
    );
    assert_eq!(out.deleted_chains.len(), 1);

    // Endpoints go to zero: 3 flushes, one element swapped between maps: 5, as upstream.
    let empty = state(vec![svc1(), svc3(&[]), svc4(&["10.0.4.1"])]);
    let out = seq.sync(&empty, &changed(&[("ns3", "svc3")]), false);
    assert_eq!(out.operations, 5, "{}", out.script());
    assert_eq!(seq.state.pending_deletions().len(), 3);

    // Restored before the stale chains were deleted: they are refilled (all three exist:
    // 5 + 4 + 4), not deleted, even when deletion is due, and one element is swapped between
    // maps: 15 (upstream: 14, with one vmap rule in the service chain).
    let s = state(vec![
        svc1(),
        svc3(&["10.0.3.2", "10.0.3.3"]),
        svc4(&["10.0.4.1"]),
    ]);
    let out = seq.sync(&s, &changed(&[("ns3", "svc3")]), true);
    assert_eq!(out.operations, 15, "{}", out.script());
    assert!(out.deleted_chains.is_empty());
    assert!(seq.state.pending_deletions().is_empty());

    // Idle again.
    let out = seq.sync(&s, &BTreeSet::new(), true);
    assert_eq!(out.operations, 0);

    seq.verify_in_kernel(&s);
}

#[test]
fn partial_sync_writes_services_that_appear_or_vanish_unreported() {
    let before = state(vec![svc1(), svc3(&["10.0.3.1"])]);
    let mut seq = Sequence::start(&before);
    // svc4 appeared, but only svc1 is reported (unchanged): svc4 is written all the same,
    // so its map elements never point at a chain that does not exist.
    let after = state(vec![svc1(), svc3(&["10.0.3.1"]), svc4(&["10.0.4.1"])]);
    let out = seq.sync(&after, &changed(&[("ns1", "svc1")]), false);
    assert_eq!(out.services_written, 2, "{}", out.script());
    // svc3 vanished, unreported: its elements go and its chains are flushed.
    let later = state(vec![svc1(), svc4(&["10.0.4.1"])]);
    let out = seq.sync(&later, &BTreeSet::new(), false);
    assert_eq!(out.services_written, 0, "{}", out.script());
    assert_eq!(out.flushed_stale.len(), 2, "{}", out.script());
    // An unreported change to a service that stays is not looked for: partial syncs do
    // not plan unchanged services (that is what keeps them cheap at 10k services), so it
    // waits for the caller's report or the next full sync.
    let moved = state(vec![svc1(), svc4(&["10.0.4.2"])]);
    let out = seq.sync(&moved, &BTreeSet::new(), false);
    assert_eq!(out.operations, 0, "{}", out.script());
    let out = seq.sync(&moved, &changed(&[("ns4", "svc4")]), false);
    assert_eq!(out.services_written, 1, "{}", out.script());
    seq.verify_in_kernel(&moved);
}

#[test]
fn affinity_sets_follow_endpoints_and_timeouts() {
    let affine = |timeout: u64, endpoints: &[&str]| {
        (
            with_affinity(cluster_ip("ns5", "svc5", "p80", "172.30.0.45", 80), timeout),
            endpoints
                .iter()
                .map(|ip| endpoint(ip, 80, false))
                .collect::<Vec<_>>(),
        )
    };
    let mut seq = Sequence::start(&state(vec![affine(10800, &["10.0.5.1", "10.0.5.2"])]));
    assert_eq!(seq.state.affinity_sets().len(), 2);
    let ns5 = changed(&[("ns5", "svc5")]);

    // An endpoint leaves: its set is deleted at once (after its chains were flushed).
    let s = state(vec![affine(10800, &["10.0.5.1"])]);
    let out = seq.sync(&s, &ns5, false);
    assert_eq!(out.deleted_sets.len(), 1);
    let flush = out.script().find("flush chain").expect("flushes");
    let delete = out.script().find("delete set").expect("deletes");
    assert!(flush < delete);

    // The timeout changes: the set is re-created rather than altered in place.
    let s = state(vec![affine(600, &["10.0.5.1"])]);
    let out = seq.sync(&s, &ns5, false);
    assert_eq!(out.deleted_sets.len(), 1);
    assert!(out.script().contains("timeout 600s"));

    // Affinity switched off: every set goes.
    let s = state(vec![(
        cluster_ip("ns5", "svc5", "p80", "172.30.0.45", 80),
        vec![endpoint("10.0.5.1", 80, false)],
    )]);
    let out = seq.sync(&s, &ns5, false);
    assert_eq!(out.deleted_sets.len(), 1);
    assert!(seq.state.affinity_sets().is_empty());
    seq.verify_in_kernel(&s);
}

#[test]
fn restart_adopts_leftovers_of_a_previous_process() {
    let old = state(vec![svc1(), svc2(), svc3(&["10.0.3.1"])]);
    let previous = full(&old, IpFamily::V4, &nft_config());
    let leftover_chains: Vec<String> = previous
        .state_after(&NftState::default())
        .chains()
        .into_iter()
        .map(str::to_owned)
        .collect();

    // The new process sees svc2 gone and knows only the object names in the table.
    let now = state(vec![svc1(), svc3(&["10.0.3.1"])]);
    let adopted = NftState::adopt(leftover_chains, Vec::new());
    let first = render_with(
        &now,
        IpFamily::V4,
        &nft_config(),
        SyncKind::Partial,
        &BTreeSet::new(),
        &adopted,
        false,
    );
    assert_eq!(
        first.kind,
        SyncKind::Full,
        "nothing known: promoted to full"
    );
    assert_eq!(
        first.flushed_stale.len(),
        2,
        "svc2's service and endpoint chains"
    );
    let cleanup = partial(
        &now,
        IpFamily::V4,
        &nft_config(),
        &BTreeSet::new(),
        &first.state_after(&adopted),
        true,
    );
    assert_eq!(cleanup.operations, 2);

    if let Some(reason) = nft_unavailable() {
        eprintln!("skipping kernel replay: {reason}");
        return;
    }
    let incremental = apply_in_netns(
        IpFamily::V4,
        &[&previous.script(), &first.script(), &cleanup.script()],
    )
    .unwrap_or_else(|e| panic!("nft rejected the restart: {e}"));
    let fresh = full(&now, IpFamily::V4, &nft_config());
    let fresh = apply_in_netns(IpFamily::V4, &[&fresh.script()]).expect("fresh render applies");
    assert_eq!(normalize_listing(&incremental), normalize_listing(&fresh));
}

#[test]
fn restart_keeps_affinity_sets_still_in_use() {
    let affine = |ns: &str, name: &str, ip: &str, timeout: u64, endpoints: &[&str]| {
        (
            with_affinity(cluster_ip(ns, name, "p80", ip, 80), timeout),
            endpoints
                .iter()
                .map(|ip| endpoint(ip, 80, false))
                .collect::<Vec<_>>(),
        )
    };
    let old = state(vec![
        affine(
            "ns5",
            "svc5",
            "172.30.0.45",
            10800,
            &["10.0.5.1", "10.0.5.2"],
        ),
        affine("ns6", "svc6", "172.30.0.46", 600, &["10.0.6.1"]),
    ]);
    let previous = full(&old, IpFamily::V4, &nft_config());
    let previous_state = previous.state_after(&NftState::default());
    let set_of = |ns_name: &str, ep: &str| -> String {
        previous_state
            .affinity_sets()
            .into_iter()
            .find(|s| s.contains(ns_name) && s.contains(ep))
            .unwrap_or_else(|| panic!("no set for {ns_name} {ep}"))
            .to_owned()
    };
    let kept = set_of("ns5/svc5", "10.0.5.1");
    let gone = set_of("ns5/svc5", "10.0.5.2");
    let retimed = set_of("ns6/svc6", "10.0.6.1");
    let timeout_of = |set: &str| if set.contains("ns5/svc5") { 10800 } else { 600 };
    let chains: Vec<String> = previous_state
        .chains()
        .into_iter()
        .map(str::to_owned)
        .collect();

    // After the restart: svc5 lost an endpoint, svc6's timeout changed.
    let now = state(vec![
        affine("ns5", "svc5", "172.30.0.45", 10800, &["10.0.5.1"]),
        affine("ns6", "svc6", "172.30.0.46", 300, &["10.0.6.1"]),
    ]);
    let adopted = NftState::adopt(
        chains.clone(),
        [&kept, &gone, &retimed].map(|s| (s.clone(), Some(timeout_of(s)))),
    );
    let first = render_with(
        &now,
        IpFamily::V4,
        &nft_config(),
        SyncKind::Full,
        &BTreeSet::new(),
        &adopted,
        false,
    );
    assert_eq!(
        first.deleted_sets,
        BTreeSet::from([gone.clone(), retimed.clone()]),
        "{}",
        first.script()
    );
    assert!(
        !first
            .script()
            .contains(&format!("delete set ip kube-proxy {kept}\n")),
        "{}",
        first.script()
    );
    assert!(
        first.script().contains("timeout 300s"),
        "{}",
        first.script()
    );

    // A set whose timeout the listing did not show is re-created.
    let unknown = NftState::adopt(chains, [(kept.clone(), None)]);
    let out = render_with(
        &now,
        IpFamily::V4,
        &nft_config(),
        SyncKind::Full,
        &BTreeSet::new(),
        &unknown,
        false,
    );
    assert_eq!(out.deleted_sets, BTreeSet::from([kept.clone()]));

    if let Some(reason) = nft_unavailable() {
        eprintln!("skipping kernel replay: {reason}");
        return;
    }
    let pin = format!("add element ip kube-proxy {kept} {{ 10.9.9.9 }}\n");
    let listing = apply_in_netns(IpFamily::V4, &[&previous.script(), &pin, &first.script()])
        .unwrap_or_else(|e| panic!("nft rejected the restart: {e}"));
    let block = listing
        .split(&format!("set {kept} {{"))
        .nth(1)
        .and_then(|rest| rest.split("\n\t}").next())
        .unwrap_or_else(|| panic!("no set {kept}: {listing}"));
    assert!(block.contains("10.9.9.9"), "pinned client lost: {listing}");
}

#[test]
fn colliding_keys_keep_the_first_service() {
    // Two services claim the same externalIP and port; the first (in name order) wins, and
    // the element moves to the other one when the first goes away.
    let mut a = cluster_ip("a", "first", "p", "172.30.0.51", 80);
    a.external_ips = vec![common::ip("192.168.99.50")];
    let mut b = cluster_ip("b", "second", "p", "172.30.0.52", 80);
    b.external_ips = vec![common::ip("192.168.99.50")];
    let both = state(vec![
        (a.clone(), vec![endpoint("10.0.9.1", 80, false)]),
        (b.clone(), vec![endpoint("10.0.9.2", 80, false)]),
    ]);
    let mut seq = Sequence::start(&both);
    let key = "192.168.99.50 . tcp . 80";
    let owner = |state: &NftState| {
        state
            .element(ElementSet::ServiceIps, key)
            .and_then(|v| v.verdict.as_ref().map(ToString::to_string))
            .unwrap_or_default()
    };
    assert!(owner(&seq.state).contains("a/first"));
    let only_b = state(vec![(b.clone(), vec![endpoint("10.0.9.2", 80, false)])]);
    let out = seq.sync(&only_b, &changed(&[("a", "first")]), false);
    assert!(owner(&seq.state).contains("b/second"));
    assert!(out.script().contains(&format!(
        "delete element ip kube-proxy service-ips {{ {key} }}"
    )));
    // The first service comes back: it holds the key again although only it was rewritten.
    let out = seq.sync(&both, &changed(&[("a", "first")]), false);
    assert!(owner(&seq.state).contains("a/first"), "{}", out.script());
    // A third service claims the key too, after both: nothing changes in the kernel.
    let c = c_only();
    let three = state(vec![
        (a, vec![endpoint("10.0.9.1", 80, false)]),
        (b.clone(), vec![endpoint("10.0.9.2", 80, false)]),
        (c, vec![endpoint("10.0.9.3", 80, false)]),
    ]);
    let out = seq.sync(&three, &changed(&[("c", "third")]), false);
    assert!(!out.script().contains(key), "{}", out.script());
    // The holder goes while both others stay unchanged: the next in order (b) takes over,
    // found among the claims the state keeps, and the state matches a fresh full sync.
    let b_and_c = state(vec![
        (b, vec![endpoint("10.0.9.2", 80, false)]),
        (c_only(), vec![endpoint("10.0.9.3", 80, false)]),
    ]);
    seq.sync(&b_and_c, &changed(&[("a", "first")]), false);
    assert!(owner(&seq.state).contains("b/second"));
    seq.sync(&b_and_c, &BTreeSet::new(), true); // deletes a's flushed chains
    let fresh = full(&b_and_c, IpFamily::V4, &nft_config()).state_after(&NftState::default());
    assert_eq!(seq.state, fresh);
    seq.verify_in_kernel(&b_and_c);
}

/// The third service of `colliding_keys_keep_the_first_service`.
fn c_only() -> ServicePort {
    let mut c = cluster_ip("c", "third", "p", "172.30.0.53", 80);
    c.external_ips = vec![common::ip("192.168.99.50")];
    c
}

#[test]
fn configuration_change_promotes_a_partial_sync_to_full() {
    let s = state(vec![svc1(), svc3(&["10.0.3.1"])]);
    let mut seq = Sequence::start(&s);
    // nodePortAddresses becomes unrestricted: the `nodeport-ips` set must go, after the
    // rules using it were flushed.
    let all = kp_rules::nftables::RenderConfig {
        node_port_addresses: kp_rules::nftables::NodePortAddresses::All,
        ..nft_config()
    };
    let out = render_with(
        &s,
        IpFamily::V4,
        &all,
        SyncKind::Partial,
        &BTreeSet::new(),
        &seq.state,
        false,
    );
    assert_eq!(out.kind, SyncKind::Full);
    assert!(
        !out.script()
            .contains("delete chain ip kube-proxy nat-output"),
        "no re-creation"
    );
    seq.scripts.push(out.script());
    if let Some(reason) = nft_unavailable() {
        eprintln!("skipping kernel replay: {reason}");
        return;
    }
    let scripts: Vec<&str> = seq.scripts.iter().map(String::as_str).collect();
    let listing = apply_in_netns(IpFamily::V4, &scripts).expect("config change applies");
    assert!(!listing.contains("nodeport-ips"), "{listing}");
    assert!(
        listing.contains("fib daddr type local ip daddr != 127.0.0.0/8"),
        "{listing}"
    );
}

#[test]
fn first_sync_replaces_an_older_upstream_layout() {
    // Upstream v1.29-v1.32: all filter base chains at dstnat - 10, a post-DNAT output chain,
    // and one "endpoints-check" chain, already holding a service.
    let old = "\
add table ip kube-proxy { comment \"rules for kube-proxy\" ; }
add chain ip kube-proxy filter-prerouting { type filter hook prerouting priority -110 ; }
add chain ip kube-proxy filter-input { type filter hook input priority -110 ; }
add chain ip kube-proxy filter-forward { type filter hook forward priority -110 ; }
add chain ip kube-proxy filter-output { type filter hook output priority -110 ; }
add chain ip kube-proxy filter-output-post-dnat { type filter hook output priority -90 ; }
add chain ip kube-proxy nat-prerouting { type nat hook prerouting priority -100 ; }
add chain ip kube-proxy endpoints-check
add chain ip kube-proxy firewall-check
add chain ip kube-proxy services
add map ip kube-proxy service-ips { type ipv4_addr . inet_proto . inet_service : verdict ; \
comment \"ClusterIP, ExternalIP and LoadBalancer IP traffic\" ; }
add rule ip kube-proxy filter-input ct state new jump endpoints-check
add rule ip kube-proxy filter-forward ct state new jump endpoints-check
add rule ip kube-proxy filter-prerouting ct state new jump firewall-check
add rule ip kube-proxy filter-output-post-dnat ct state new jump firewall-check
add rule ip kube-proxy nat-prerouting jump services
add rule ip kube-proxy services ip daddr . meta l4proto . th dport vmap @service-ips
add chain ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80
add element ip kube-proxy service-ips { 172.30.0.41 . tcp . 80 : goto service-ULMVA6XW-ns1/svc1/tcp/p80 }
";
    let s = state(vec![svc1()]);
    let adopted = NftState::adopt(["service-ULMVA6XW-ns1/svc1/tcp/p80".to_owned()], Vec::new());
    let first = render_with(
        &s,
        IpFamily::V4,
        &nft_config(),
        SyncKind::Full,
        &BTreeSet::new(),
        &adopted,
        false,
    );
    assert!(first.flushed_stale.is_empty(), "svc1's chain is reused");
    if let Some(reason) = nft_unavailable() {
        eprintln!("skipping kernel replay: {reason}");
        return;
    }
    let upgraded = apply_in_netns(IpFamily::V4, &[old, &first.script()])
        .unwrap_or_else(|e| panic!("upgrade failed: {e}"));
    let fresh = apply_in_netns(
        IpFamily::V4,
        &[&full(&s, IpFamily::V4, &nft_config()).script()],
    )
    .expect("fresh applies");
    assert_eq!(normalize_listing(&upgraded), normalize_listing(&fresh));
    assert!(
        !upgraded.contains("\tchain endpoints-check {"),
        "{upgraded}"
    );
    assert!(
        !upgraded.contains("chain filter-prerouting {"),
        "{upgraded}"
    );
}
