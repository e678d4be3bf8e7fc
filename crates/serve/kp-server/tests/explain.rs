//! `/debug/explain` on the metrics listener: off by default, answers in text or JSON when
//! enabled, 400 with a clear message for a bad query, and never holds up the other endpoints
//! while an answer is being computed.

use crate::common;

use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex, PoisonError};

use common::{get, local_listener, request_with};
use kp_rules::explain::Query;
use kp_server::{
    ExplainFailure, Explained, Explainer, MetricsInfo, serve_metrics, serve_metrics_with_explain,
};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

fn info() -> MetricsInfo {
    MetricsInfo {
        proxy_mode: "iptables".to_owned(),
        configz: serde_json::json!({ "mode": "iptables" }),
        zpages: None,
        native: Default::default(),
    }
}

/// Answers with the query it got; 192.0.2.1 is "not ready yet", a source of 192.0.2.99 is a
/// query the explainer itself rejects.
#[derive(Default)]
struct Echo {
    seen: Mutex<Vec<Query>>,
}

impl Explainer for Echo {
    fn explain(&self, query: &Query) -> Result<Explained, ExplainFailure> {
        self.seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(*query);
        let dest = query.destination.ip.to_string();
        if dest == "192.0.2.1" {
            return Err(ExplainFailure::Unavailable("no sync yet".to_owned()));
        }
        if query.source.map(|s| s.to_string()).as_deref() == Some("192.0.2.99") {
            return Err(ExplainFailure::BadQuery("families differ".to_owned()));
        }
        Ok(Explained {
            text: format!("explained {dest}\n"),
            json: serde_json::json!({ "dest": dest, "port": query.destination.port }),
        })
    }
}

async fn start(explainer: Option<Arc<dyn Explainer>>) -> (std::net::SocketAddr, CancellationToken) {
    let (listener, addr) = local_listener().await;
    let shutdown = CancellationToken::new();
    tokio::spawn(serve_metrics_with_explain(
        listener,
        Arc::new(Registry::default()),
        info(),
        explainer,
        shutdown.clone(),
    ));
    (addr, shutdown)
}

#[tokio::test]
async fn off_by_default() {
    let (listener, addr) = local_listener().await;
    let shutdown = CancellationToken::new();
    tokio::spawn(serve_metrics(
        listener,
        Arc::new(Registry::default()),
        info(),
        shutdown.clone(),
    ));
    assert_eq!(
        get(addr, "/debug/explain?dest=10.96.0.10:80").await.status,
        404
    );
    // Still serving the rest.
    assert_eq!(get(addr, "/healthz").await.status, 200);
    shutdown.cancel();

    let (addr, shutdown) = start(None).await;
    assert_eq!(
        get(addr, "/debug/explain?dest=10.96.0.10:80").await.status,
        404
    );
    shutdown.cancel();
}

#[tokio::test]
async fn answers_in_text_or_json() {
    let echo = Arc::new(Echo::default());
    let (addr, shutdown) = start(Some(echo.clone())).await;

    let text = get(
        addr,
        "/debug/explain?dest=10.96.0.10:80/udp&from=10.244.1.2",
    )
    .await;
    assert_eq!(text.status, 200, "{}", text.body);
    assert_eq!(text.body, "explained 10.96.0.10\n");
    assert_eq!(
        text.header("content-type"),
        Some("text/plain; charset=utf-8")
    );

    let json = get(addr, "/debug/explain?dest=10.96.0.10%3A80&format=json").await;
    assert_eq!(json.status, 200, "{}", json.body);
    assert_eq!(json.header("content-type"), Some("application/json"));
    assert_eq!(
        json.json(),
        serde_json::json!({ "dest": "10.96.0.10", "port": 80 })
    );

    let accept = request_with(
        addr,
        "GET",
        "/debug/explain?dest=10.96.0.10",
        &[("Accept", "application/json")],
    )
    .await
    .expect("request");
    assert_eq!(accept.status, 200);
    assert_eq!(accept.json()["dest"], "10.96.0.10");
    // format=text wins over Accept.
    let forced = request_with(
        addr,
        "GET",
        "/debug/explain?dest=10.96.0.10&format=text",
        &[("Accept", "application/json")],
    )
    .await
    .expect("request");
    assert_eq!(forced.body, "explained 10.96.0.10\n");

    let seen = echo
        .seen
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    assert_eq!(seen.len(), 4);
    let first = seen[0];
    assert_eq!(first.destination.port, Some(80));
    assert_eq!(format!("{:?}", first.destination.protocol), "Udp");
    assert_eq!(first.source, Some("10.244.1.2".parse().expect("literal")));
    assert_eq!(seen[2].destination.port, None);
    shutdown.cancel();
}

#[tokio::test]
async fn bad_queries_get_400_with_what_is_wrong() {
    let echo = Arc::new(Echo::default());
    let (addr, shutdown) = start(Some(echo.clone())).await;
    for (path, says) in [
        ("/debug/explain", "missing dest"),
        ("/debug/explain?dest=", "missing dest"),
        ("/debug/explain?from=10.0.0.1", "missing dest"),
        ("/debug/explain?dest=not-an-ip", "bad dest \"not-an-ip\""),
        ("/debug/explain?dest=10.0.0.1:99999", "bad dest"),
        ("/debug/explain?dest=10.0.0.1/icmp", "bad dest"),
        (
            "/debug/explain?dest=10.0.0.1&from=nowhere",
            "bad from \"nowhere\"",
        ),
        (
            "/debug/explain?dest=10.0.0.1&format=xml",
            "bad format \"xml\"",
        ),
        (
            "/debug/explain?dest=10.0.0.1&from=192.0.2.99",
            "families differ",
        ),
    ] {
        let response = get(addr, path).await;
        assert_eq!(response.status, 400, "{path}: {}", response.body);
        assert!(response.body.contains(says), "{path}: {}", response.body);
        assert!(
            response.body.contains("usage: /debug/explain?dest="),
            "{}",
            response.body
        );
    }
    // Only the last query reached the explainer: the others were refused before it.
    assert_eq!(
        echo.seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len(),
        1
    );

    let unavailable = get(addr, "/debug/explain?dest=192.0.2.1").await;
    assert_eq!(unavailable.status, 503);
    assert!(unavailable.body.contains("no sync yet"));
    shutdown.cancel();
}

/// Blocks inside `explain` until released, reporting when it got there.
struct Stuck {
    entered: Mutex<std_mpsc::Sender<()>>,
    release: Mutex<std_mpsc::Receiver<()>>,
}

impl Explainer for Stuck {
    fn explain(&self, _query: &Query) -> Result<Explained, ExplainFailure> {
        let _ = self
            .entered
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .send(());
        let _ = self
            .release
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .recv();
        Ok(Explained {
            text: "late\n".to_owned(),
            json: serde_json::Value::Null,
        })
    }
}

#[tokio::test]
async fn a_slow_answer_does_not_hold_up_the_other_endpoints() {
    let (entered_tx, entered_rx) = std_mpsc::channel();
    let (release_tx, release_rx) = std_mpsc::channel();
    let stuck = Arc::new(Stuck {
        entered: Mutex::new(entered_tx),
        release: Mutex::new(release_rx),
    });
    let (addr, shutdown) = start(Some(stuck)).await;
    let pending = tokio::spawn(async move { get(addr, "/debug/explain?dest=10.96.0.10").await });
    tokio::task::spawn_blocking(move || entered_rx.recv())
        .await
        .expect("join")
        .expect("the explainer was entered");
    // The explain request is stuck inside the explainer; the server still answers.
    assert_eq!(get(addr, "/healthz").await.status, 200);
    assert_eq!(get(addr, "/metrics").await.status, 200);
    assert!(!pending.is_finished());
    release_tx.send(()).expect("release");
    let response = pending.await.expect("join");
    assert_eq!((response.status, response.body.as_str()), (200, "late\n"));
    shutdown.cancel();
}
