//! The proxy health server on the wire.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::{get, local_listener, request};
use kp_core::health::ProxyHealth;
use kp_core::model::IpFamily;
use kp_server::{HealthMetrics, serve_health};
use prometheus_client::registry::Registry;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

struct Server {
    addr: std::net::SocketAddr,
    registry: Registry,
    shutdown: CancellationToken,
    task: JoinHandle<Result<(), kp_server::ServerError>>,
}

async fn start(health: Arc<ProxyHealth>, families: Vec<IpFamily>) -> Server {
    let (listener, addr) = local_listener().await;
    let mut registry = Registry::default();
    let metrics = HealthMetrics::register(&mut registry);
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(serve_health(
        listener,
        health,
        families,
        metrics,
        shutdown.clone(),
    ));
    Server {
        addr,
        registry,
        shutdown,
        task,
    }
}

fn timestamp(value: &serde_json::Value) -> jiff::Timestamp {
    let text = value
        .as_str()
        .unwrap_or_else(|| panic!("{value} is not a string"));
    assert!(text.ends_with('Z'), "{text} is not UTC");
    text.parse()
        .unwrap_or_else(|e| panic!("{text} is not RFC 3339: {e}"))
}

fn encode(registry: &Registry) -> String {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).expect("encodable");
    text
}

#[tokio::test]
async fn healthy_proxy_answers_200_with_upstream_body() {
    let health = Arc::new(ProxyHealth::new(Duration::from_secs(30)));
    health.updated();
    let server = start(health, vec![IpFamily::V4, IpFamily::V6]).await;

    let before = jiff::Timestamp::now();
    let resp = get(server.addr, "/healthz").await;
    assert_eq!(resp.status, 200);
    assert_eq!(resp.header("content-type"), Some("application/json"));
    assert_eq!(resp.header("x-content-type-options"), Some("nosniff"));
    let body = resp.json();
    assert_eq!(body["healthy"], true);
    assert_eq!(body["nodeEligible"], true);
    let current = timestamp(&body["currentTime"]);
    assert!(
        current >= before && current <= jiff::Timestamp::now(),
        "{current} not now"
    );
    // On success lastUpdated is "now", for backward compatibility.
    assert_eq!(body["lastUpdated"], body["currentTime"]);
    for family in ["IPv4", "IPv6"] {
        let status = &body["status"][family];
        assert_eq!(status["healthy"], true, "{body}");
        // Per family, the real sync time (moments ago).
        let synced = timestamp(&status["lastUpdated"]);
        assert!(synced <= current && synced >= before - jiff::SignedDuration::from_secs(5));
    }
    assert_eq!(body["status"].as_object().map(|m| m.len()), Some(2));

    let live = get(server.addr, "/livez").await;
    assert_eq!(live.status, 200);
    let body = live.json();
    assert_eq!(body["healthy"], true);
    assert!(
        body.get("nodeEligible").is_none(),
        "/livez has no nodeEligible: {body}"
    );
    assert_eq!(body["status"].as_object().map(|m| m.len()), Some(2));
}

#[tokio::test]
async fn only_configured_families_are_reported() {
    let health = Arc::new(ProxyHealth::new(Duration::from_secs(30)));
    health.updated();
    let server = start(health, vec![IpFamily::V6]).await;
    let body = get(server.addr, "/healthz").await.json();
    let families: Vec<&String> = body["status"]
        .as_object()
        .expect("status map")
        .keys()
        .collect();
    assert_eq!(families, ["IPv6"]);
}

#[tokio::test]
async fn overdue_update_makes_both_endpoints_fail() {
    let health = Arc::new(ProxyHealth::with_timeout(Duration::ZERO));
    health.updated();
    tokio::time::sleep(Duration::from_millis(20)).await;
    health.queued_update();
    let server = start(health, vec![IpFamily::V4]).await;

    for path in ["/healthz", "/livez"] {
        let resp = get(server.addr, path).await;
        assert_eq!(resp.status, 503, "{path}");
        let body = resp.json();
        assert_eq!(body["healthy"], false);
        assert_eq!(body["status"]["IPv4"]["healthy"], false);
        // Unhealthy: lastUpdated is the real last sync, before the current time.
        let last = timestamp(&body["lastUpdated"]);
        let current = timestamp(&body["currentTime"]);
        assert!(
            current.duration_since(last) >= jiff::SignedDuration::from_millis(20),
            "{body}"
        );
        assert_eq!(body["status"]["IPv4"]["lastUpdated"], body["lastUpdated"]);
    }
}

#[tokio::test]
async fn never_synced_and_overdue_reports_go_zero_time() {
    let health = Arc::new(ProxyHealth::with_timeout(Duration::ZERO));
    health.queued_update();
    let server = start(health, vec![IpFamily::V4]).await;
    let resp = get(server.addr, "/healthz").await;
    assert_eq!(resp.status, 503);
    let body = resp.json();
    assert_eq!(body["lastUpdated"], "0001-01-01T00:00:00Z");
    assert!(body.get("status").is_none(), "no family has synced: {body}");
}

#[tokio::test]
async fn ineligible_node_fails_healthz_but_not_livez() {
    let health = Arc::new(ProxyHealth::new(Duration::from_secs(30)));
    health.updated();
    health.set_node_eligible(false);
    let server = start(health, vec![IpFamily::V4]).await;

    let resp = get(server.addr, "/healthz").await;
    assert_eq!(resp.status, 503);
    let body = resp.json();
    assert_eq!(body["nodeEligible"], false);
    // As upstream, `healthy` is the proxy's own health.
    assert_eq!(body["healthy"], true);

    assert_eq!(get(server.addr, "/livez").await.status, 200);
}

#[tokio::test]
async fn responses_are_counted_by_code() {
    let health = Arc::new(ProxyHealth::new(Duration::from_secs(30)));
    let server = start(health.clone(), vec![IpFamily::V4]).await;
    assert_eq!(get(server.addr, "/healthz").await.status, 200);
    assert_eq!(get(server.addr, "/healthz").await.status, 200);
    assert_eq!(get(server.addr, "/livez").await.status, 200);
    health.set_node_eligible(false);
    assert_eq!(get(server.addr, "/healthz").await.status, 503);

    let text = encode(&server.registry);
    assert!(
        text.contains("# TYPE kubeproxy_proxy_healthz counter\n"),
        "{text}"
    );
    assert!(
        text.contains("kubeproxy_proxy_healthz_total{code=\"200\"} 2\n"),
        "{text}"
    );
    assert!(
        text.contains("kubeproxy_proxy_healthz_total{code=\"503\"} 1\n"),
        "{text}"
    );
    assert!(
        text.contains("kubeproxy_proxy_livez_total{code=\"200\"} 1\n"),
        "{text}"
    );
    assert!(
        !text.contains("kubeproxy_proxy_livez_total{code=\"503\"}"),
        "{text}"
    );
}

#[tokio::test]
async fn any_method_is_served_and_unknown_paths_are_404() {
    let health = Arc::new(ProxyHealth::new(Duration::from_secs(30)));
    let server = start(health, vec![IpFamily::V4]).await;
    let resp = request(server.addr, "POST", "/healthz")
        .await
        .expect("POST");
    assert_eq!(resp.status, 200);
    assert_eq!(get(server.addr, "/metrics").await.status, 404);
}

#[tokio::test]
async fn shutdown_stops_the_server() {
    let health = Arc::new(ProxyHealth::new(Duration::from_secs(30)));
    let server = start(health, vec![IpFamily::V4]).await;
    assert_eq!(get(server.addr, "/healthz").await.status, 200);
    server.shutdown.cancel();
    let result = tokio::time::timeout(Duration::from_secs(2), server.task)
        .await
        .expect("stops promptly");
    assert!(matches!(result, Ok(Ok(()))), "{result:?}");
    assert!(
        tokio::net::TcpStream::connect(server.addr).await.is_err(),
        "listener closed"
    );
}
