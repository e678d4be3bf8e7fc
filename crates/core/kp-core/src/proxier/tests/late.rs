//! Late state converges: objects arriving in the unlucky order on purpose. This node's Node
//! after Services and EndpointSlices (the first sync waits for its labels, bounded), and a
//! ServiceCIDR during the first sync or while running (the next sync carries it).

use super::*;
use crate::fixtures::service_cidr;

const NODE_WAIT: Duration = Duration::from_secs(30);

fn zone(z: &str) -> serde_json::Value {
    json!({"topology.kubernetes.io/zone": z})
}

fn web() -> Vec<SourceEvent> {
    vec![
        applied(service("web", "172.30.0.41")),
        applied(slice("web-a", "web", &[("10.180.0.1", Some(NODE), true)])),
    ]
}

#[tokio::test(start_paused = true)]
async fn the_first_sync_waits_for_the_expected_node_and_uses_its_labels() {
    let h = Harness::start_with(|c| c.with_node_wait(NODE_WAIT));
    h.initialize(web()).await;
    run_for(Duration::from_secs(2)).await;
    assert_eq!(h.syncs().len(), 0, "waits for the Node");
    h.send(applied(node(NODE, zone("a"), json!({})))).await;
    settle().await;
    let syncs = h.syncs();
    assert_eq!(syncs.len(), 1, "the Node came: the first sync runs");
    assert_eq!(syncs[0].kind, SyncKind::Full);
    assert_eq!(syncs[0].state.node.zone(), Some("a"), "with its labels");
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn without_an_expected_node_the_first_sync_does_not_wait() {
    let h = Harness::start();
    h.initialize(web()).await;
    assert_eq!(h.syncs().len(), 1);
    assert_eq!(h.last_sync().state.node.zone(), None);
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn the_node_wait_is_bounded_and_ends_when_the_list_lacks_the_node() {
    let h = Harness::start_with(|c| c.with_node_wait(NODE_WAIT));
    h.initialize(web()).await;
    run_for(NODE_WAIT - Duration::from_millis(10)).await;
    assert_eq!(h.syncs().len(), 0);
    run_for(Duration::from_millis(20)).await;
    assert_eq!(
        h.syncs().len(),
        1,
        "programmed without the Node after the bound"
    );
    // The Node still comes later: its labels make the next sync full.
    h.send(applied(node(NODE, zone("a"), json!({})))).await;
    run_for(Duration::from_secs(2)).await;
    assert_eq!(h.syncs().len(), 2);
    assert_eq!(h.last_sync().kind, SyncKind::Full);
    assert_eq!(h.last_sync().state.node.zone(), Some("a"));
    h.stop().await;

    // The Node list ends without this node's Node: nothing to wait for.
    let h = Harness::start_with(|c| c.with_node_wait(NODE_WAIT));
    h.initialize(web()).await;
    assert_eq!(h.syncs().len(), 0);
    h.send(SourceEvent::Node(ObjectEvent::Synced)).await;
    settle().await;
    assert_eq!(h.syncs().len(), 1);
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_service_cidr_arriving_during_the_first_sync_reaches_the_next_one() {
    let h = Harness::start();
    h.backend.take(Duration::from_millis(500));
    h.initialize(web()).await;
    // The first sync is under way (it takes 500 ms): the ServiceCIDR arrives meanwhile.
    run_for(Duration::from_millis(4)).await;
    h.send(applied(service_cidr("kubernetes", &["10.96.0.0/16"])))
        .await;
    run_for(Duration::from_secs(3)).await;
    let syncs = h.syncs();
    assert_eq!(syncs.len(), 2, "one more sync for the ServiceCIDR");
    assert!(syncs[0].state.service_cidrs.is_empty());
    assert_eq!(
        syncs[1].state.service_cidrs,
        ["10.96.0.0/16".parse::<ipnet::IpNet>().expect("literal")]
    );
    // Nothing else changed: a partial sync of no service (nftables mode rewrites its fixed
    // rules, the drop among them, whenever the ranges differ from what it wrote).
    assert_eq!(syncs[1].kind, SyncKind::Partial);
    assert!(syncs[1].changed.is_empty());

    // Created and deleted while running: each reaches the next sync.
    h.send(applied(service_cidr("extra", &["10.97.0.0/16"])))
        .await;
    run_for(Duration::from_secs(3)).await;
    assert_eq!(h.last_sync().state.service_cidrs.len(), 2);
    h.send(deleted(service_cidr("kubernetes", &["10.96.0.0/16"])))
        .await;
    run_for(Duration::from_secs(3)).await;
    assert_eq!(
        h.last_sync().state.service_cidrs,
        ["10.97.0.0/16".parse::<ipnet::IpNet>().expect("literal")]
    );
    assert_eq!(h.syncs().len(), 4);
    h.stop().await;
}
