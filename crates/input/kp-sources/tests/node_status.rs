//! `Node.status.nodeInfo.kubeProxyVersion` is never written (upstream deprecated the field
//! and stopped filling it; issue 35): every request the proxy's API clients make (the Node
//! read at start-up, the lists and watches of the source, an Event about the Node) is
//! recorded at the fake API server (`kp_testbed::apiserver`), and none of them writes a Node
//! or any `status` subresource; the Node the server holds is the one it was given.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::extract::Request;
use axum::http::Method;
use axum::middleware::{self, Next};
use kp_core::event::{ObjectEvent, SourceEvent};
use kp_sources::api::ApiSource;
use kp_sources::events::{ACTION_START, EventType, NodeEvent, NodeEvents};
use kp_sources::node::{NodeWait, wait_for_api_node};
use kp_testbed::apiserver::{FakeApiServer, NODES, SERVICES, SLICES};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(10);
const EVENTS_PATH: &str = "/apis/events.k8s.io/v1/namespaces/default/events";

type Seen = Arc<Mutex<Vec<(Method, String)>>>;

fn node() -> Value {
    json!({ "metadata": { "name": "node-a", "labels": { "topology.kubernetes.io/zone": "z" } },
            "status": { "addresses": [{ "type": "InternalIP", "address": "192.168.50.2" }],
                        "nodeInfo": { "kubeletVersion": "v1.37.0" } } })
}

/// The fake API server behind a layer recording every request's method and path.
async fn serving(fake: &FakeApiServer) -> (kube::Client, Seen) {
    let seen: Seen = Arc::default();
    let record = seen.clone();
    let app = fake
        .router(false)
        .layer(middleware::from_fn(move |req: Request, next: Next| {
            let record = record.clone();
            async move {
                record
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push((req.method().clone(), req.uri().path().to_owned()));
                next.run(req).await
            }
        }));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let url = format!("http://{addr}").parse().expect("url");
    let client = kube::Client::try_from(kube::Config::new(url)).expect("client");
    (client, seen)
}

/// Receives events until Services, EndpointSlices and the Node are each synced.
async fn until_synced(rx: &mut mpsc::Receiver<SourceEvent>) {
    let mut kinds = std::collections::BTreeSet::new();
    while kinds.len() < 3 {
        let kind = match timeout(WAIT, rx.recv()).await.expect("an event in time") {
            Some(SourceEvent::Service(ObjectEvent::Synced)) => "services",
            Some(SourceEvent::EndpointSlice(ObjectEvent::Synced)) => "slices",
            Some(SourceEvent::Node(ObjectEvent::Synced)) => "node",
            Some(_) => continue,
            None => panic!("the source stopped"),
        };
        kinds.insert(kind);
    }
}

#[tokio::test]
async fn no_request_writes_the_node_or_a_status() {
    let fake = FakeApiServer::new(100);
    fake.put(NODES, node());
    let (client, seen) = serving(&fake).await;
    let shutdown = CancellationToken::new();

    let wait = wait_for_api_node(
        client.clone(),
        "node-a",
        Duration::from_millis(20),
        WAIT,
        &shutdown,
    )
    .await;
    assert!(matches!(wait, NodeWait::Found(_)), "{wait:?}");

    let (tx, mut rx) = mpsc::channel(64);
    let source = ApiSource::new(client.clone(), "node-a").retry_delay(Duration::from_millis(20));
    let task = tokio::spawn(source.run(tx, shutdown.clone()));
    until_synced(&mut rx).await;
    // A Node change while watched (its status too) is read, never answered with a write.
    let mut changed = node();
    changed["status"]["nodeInfo"]["kubeletVersion"] = json!("v1.37.1");
    fake.apply(NODES, "MODIFIED", changed.clone());
    let event = timeout(WAIT, rx.recv()).await.expect("in time");
    assert!(
        matches!(event, Some(SourceEvent::Node(ObjectEvent::Applied(_)))),
        "{event:?}"
    );

    let event = NodeEvent {
        kind: EventType::Warning,
        reason: "ProxyModeDefaulted",
        action: ACTION_START,
        note: "no mode given".to_owned(),
    };
    NodeEvents::new(client, "node-a", "host-a")
        .post(&event)
        .await
        .expect("event posted");
    shutdown.cancel();
    let _ = timeout(WAIT, task).await.expect("source stops");

    let seen = seen.lock().unwrap_or_else(PoisonError::into_inner).clone();
    for (method, path) in [
        (Method::GET, "/api/v1/nodes/node-a"),
        (Method::GET, "/api/v1/nodes"),
    ] {
        assert!(
            seen.contains(&(method, path.to_owned())),
            "{path}: {seen:?}"
        );
    }
    for resource in [SERVICES, SLICES] {
        assert!(
            seen.iter()
                .any(|(m, p)| m == Method::GET && p.ends_with(resource)),
            "{resource}: {seen:?}"
        );
    }
    let writes: Vec<_> = seen.iter().filter(|(m, _)| m != Method::GET).collect();
    assert_eq!(
        writes,
        [&(Method::POST, EVENTS_PATH.to_owned())],
        "{seen:?}"
    );
    assert!(!seen.iter().any(|(_, p)| p.contains("/status")), "{seen:?}");

    let held = fake
        .remove(NODES, "node-a")
        .expect("the Node is still there");
    assert_eq!(
        held["status"], changed["status"],
        "the Node as the server was given it"
    );
    assert!(held["status"]["nodeInfo"].get("kubeProxyVersion").is_none());
}
