//! Events about the Node, posted to the fake API server (`kp_testbed::apiserver`) over HTTP
//! as the proxy posts them: the object upstream's recorder makes, retries while the server
//! cannot be reached, and no retry once it answers.

use std::net::SocketAddr;
use std::time::{Duration, SystemTime};

use kp_sources::events::{ACTION_START, EventError, EventType, NodeEvent, NodeEvents};
use kp_testbed::apiserver::FakeApiServer;
use tokio::net::TcpListener;

fn client(addr: SocketAddr) -> kube::Client {
    let url = format!("http://{addr}").parse().expect("url");
    kube::Client::try_from(kube::Config::new(url)).expect("client")
}

async fn serve(fake: &FakeApiServer, listener: TcpListener) {
    let app = fake.router(true);
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
}

/// A fake API server serving on a port of its own.
async fn serving() -> (FakeApiServer, SocketAddr) {
    let fake = FakeApiServer::new(1);
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    serve(&fake, listener).await;
    (fake, addr)
}

fn deprecation() -> NodeEvent {
    NodeEvent {
        kind: EventType::Warning,
        reason: "IPVSDeprecation",
        action: ACTION_START,
        note: "ipvs mode is deprecated".to_owned(),
    }
}

#[tokio::test]
async fn an_event_reaches_the_server_in_upstreams_shape() {
    let (fake, addr) = serving().await;
    let events = NodeEvents::new(client(addr), "node-a", "host-a");
    let before = SystemTime::now();
    events.post(&deprecation()).await.expect("posted");

    let posted = fake.events();
    assert_eq!(posted.len(), 1, "{posted:?}");
    let e = &posted[0];
    assert_eq!(e["apiVersion"], "events.k8s.io/v1", "{e}");
    assert_eq!(e["metadata"]["namespace"], "default", "{e}");
    assert_eq!(e["type"], "Warning", "{e}");
    assert_eq!(e["reason"], "IPVSDeprecation", "{e}");
    assert_eq!(e["action"], "StartKubeProxy", "{e}");
    assert_eq!(e["note"], "ipvs mode is deprecated", "{e}");
    assert_eq!(e["reportingController"], "kube-proxy", "{e}");
    assert_eq!(e["reportingInstance"], "kube-proxy-host-a", "{e}");
    assert_eq!(e["regarding"]["apiVersion"], "v1", "{e}");
    assert_eq!(e["regarding"]["kind"], "Node", "{e}");
    assert_eq!(e["regarding"]["name"], "node-a", "{e}");
    assert!(
        e["eventTime"].as_str().is_some_and(|t| t.contains('T')),
        "{e}"
    );
    // `<node>.<unix nanoseconds in hex>`, taken when the event was made.
    let name = e["metadata"]["name"].as_str().unwrap_or_default();
    let nanos = name
        .strip_prefix("node-a.")
        .and_then(|hex| u128::from_str_radix(hex, 16).ok())
        .unwrap_or_else(|| panic!("name {name:?}"));
    let made = SystemTime::UNIX_EPOCH + Duration::from_nanos(u64::try_from(nanos).unwrap_or(0));
    assert!(made >= before && made <= SystemTime::now(), "{name}");
}

#[tokio::test]
async fn a_server_that_does_not_answer_yet_gets_the_event_when_it_does() {
    // A port nobody listens on until the server starts there, after the first tries failed.
    let probe = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = probe.local_addr().expect("address");
    drop(probe);
    let events =
        NodeEvents::new(client(addr), "node-a", "host-a").retry(50, Duration::from_millis(100));
    let post = tokio::spawn(async move { events.post(&deprecation()).await });
    tokio::time::sleep(Duration::from_millis(350)).await;
    let fake = FakeApiServer::new(1);
    serve(&fake, TcpListener::bind(addr).await.expect("rebind")).await;
    post.await
        .expect("task")
        .expect("posted once the server answers");
    assert_eq!(fake.events().len(), 1);
}

#[tokio::test]
async fn an_answer_from_the_server_is_final() {
    let (fake, addr) = serving().await;
    fake.refuse_events(1);
    let events =
        NodeEvents::new(client(addr), "node-a", "host-a").retry(5, Duration::from_millis(10));
    let err = events.post(&deprecation()).await.expect_err("refused");
    assert!(matches!(err, EventError::Refused(_)), "{err}");
    assert!(fake.events().is_empty());

    let gone = NodeEvents::new(client(addr), "node-a", "host-a").retry(3, Duration::ZERO);
    let unreachable = NodeEvents::new(
        client("127.0.0.1:9".parse().expect("address")),
        "node-a",
        "host-a",
    )
    .retry(3, Duration::ZERO);
    gone.post(&deprecation())
        .await
        .expect("the next post is taken");
    let err = unreachable
        .post(&deprecation())
        .await
        .expect_err("nobody listens");
    assert!(
        matches!(err, EventError::Unreachable { tries: 3, .. }),
        "{err}"
    );
}
