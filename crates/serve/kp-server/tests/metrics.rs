//! The metrics server on the wire.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{get, local_listener};
use kp_core::health::ProxyHealth;
use kp_core::model::IpFamily;
use kp_server::metrics::OPENMETRICS_CONTENT_TYPE;
use kp_server::{HealthMetrics, MetricsInfo, serve_health, serve_metrics};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

fn info() -> MetricsInfo {
    MetricsInfo {
        proxy_mode: "nftables".to_owned(),
        configz: serde_json::json!({ "mode": "nftables", "bindAddress": "0.0.0.0" }),
    }
}

#[tokio::test]
async fn serves_metrics_healthz_proxy_mode_and_configz() {
    let mut registry = Registry::default();
    let syncs: Counter = Counter::default();
    registry.register("kubeproxy_test_syncs", "Test syncs", syncs.clone());
    syncs.inc_by(3);
    let (listener, addr) = local_listener().await;
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(serve_metrics(
        listener,
        Arc::new(registry),
        info(),
        shutdown.clone(),
    ));

    let metrics = get(addr, "/metrics").await;
    assert_eq!(metrics.status, 200);
    assert_eq!(
        metrics.header("content-type"),
        Some(OPENMETRICS_CONTENT_TYPE)
    );
    assert!(
        metrics.body.contains("kubeproxy_test_syncs_total 3\n"),
        "{}",
        metrics.body
    );
    assert!(metrics.body.ends_with("# EOF\n"), "{}", metrics.body);

    let healthz = get(addr, "/healthz").await;
    assert_eq!((healthz.status, healthz.body.as_str()), (200, "ok"));
    assert_eq!(
        healthz.header("content-type"),
        Some("text/plain; charset=utf-8")
    );

    let mode = get(addr, "/proxyMode").await;
    assert_eq!((mode.status, mode.body.as_str()), (200, "nftables"));
    assert_eq!(
        mode.header("content-type"),
        Some("text/plain; charset=utf-8")
    );

    let configz = get(addr, "/configz").await;
    assert_eq!(configz.status, 200);
    assert_eq!(configz.header("content-type"), Some("application/json"));
    assert_eq!(configz.header("x-content-type-options"), Some("nosniff"));
    assert_eq!(
        configz.json(),
        serde_json::json!({ "kubeproxy.config.k8s.io": { "mode": "nftables", "bindAddress": "0.0.0.0" } })
    );

    assert_eq!(get(addr, "/nope").await.status, 404);

    shutdown.cancel();
    let result = tokio::time::timeout(Duration::from_secs(2), task)
        .await
        .expect("stops promptly");
    assert!(matches!(result, Ok(Ok(()))), "{result:?}");
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "listener closed"
    );
}

/// The health counters registered in the shared registry are what `/metrics` exposes.
#[tokio::test]
async fn health_counters_show_up_on_metrics() {
    let mut registry = Registry::default();
    let health_metrics = HealthMetrics::register(&mut registry);
    let shutdown = CancellationToken::new();
    let (health_listener, health_addr) = local_listener().await;
    let (metrics_listener, metrics_addr) = local_listener().await;
    let health = Arc::new(ProxyHealth::new(Duration::from_secs(30)));
    tokio::spawn(serve_health(
        health_listener,
        health,
        vec![IpFamily::V4],
        health_metrics,
        shutdown.clone(),
    ));
    tokio::spawn(serve_metrics(
        metrics_listener,
        Arc::new(registry),
        info(),
        shutdown.clone(),
    ));

    assert_eq!(get(health_addr, "/livez").await.status, 200);
    let text = get(metrics_addr, "/metrics").await.body;
    assert!(
        text.contains("kubeproxy_proxy_livez_total{code=\"200\"} 1\n"),
        "{text}"
    );
    shutdown.cancel();
}
