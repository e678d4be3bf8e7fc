//! The metrics server on the wire.

use crate::common;

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
        zpages: None,
        native: Default::default(),
    }
}

/// `/statusz` and `/flagz` (KEP-4827/4828): text by default, the structured object only for
/// the `Accept` header the KEPs name, 406 otherwise.
#[tokio::test]
async fn statusz_and_flagz_negotiate_as_upstream() {
    let pages = info_pages();
    let (addr, shutdown, task) = serve_pages(pages).await;
    let with = |path: &'static str, accept: &'static str| async move {
        common::request_with(addr, "GET", path, &[("Accept", accept)])
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"))
    };

    let text = get(addr, "/statusz").await;
    assert_eq!(text.status, 200);
    assert_eq!(
        text.header("content-type"),
        Some("text/plain; charset=utf-8")
    );
    for part in [
        "kube-proxy statusz",
        "Binary version: kube-proxy-rs 9.9.9",
        "Emulation version: 1.36",
    ] {
        assert!(text.body.contains(part), "{part}: {}", text.body);
    }
    assert!(
        text.body
            .contains("Paths: /configz /flagz /healthz /metrics /proxyMode /statusz"),
        "{}",
        text.body
    );
    let json = with(
        "/statusz",
        "application/json;as=Statusz;v=v1beta1;g=config.k8s.io",
    )
    .await;
    assert_eq!(json.status, 200);
    assert_eq!(json.header("content-type"), Some("application/json"));
    let object = json.json();
    assert_eq!(object["kind"], "Statusz", "{object}");
    assert_eq!(object["apiVersion"], "config.k8s.io/v1beta1", "{object}");
    assert_eq!(object["metadata"]["name"], "kube-proxy", "{object}");
    let uptime = object["uptimeSeconds"].as_u64().unwrap_or_default();
    assert!((90..600).contains(&uptime), "{object}");
    assert_eq!(object["paths"][1], "/flagz", "{object}");
    let old = with(
        "/statusz",
        "application/json;as=Statusz;v=v1alpha1;g=config.k8s.io",
    )
    .await;
    assert_eq!(old.status, 200);
    assert!(
        old.header("warning")
            .is_some_and(|w| w.contains("deprecated"))
    );
    assert_eq!(with("/statusz", "application/json").await.status, 406);
    assert_eq!(
        with(
            "/statusz",
            "application/json;as=Flagz;v=v1beta1;g=config.k8s.io"
        )
        .await
        .status,
        406
    );

    let text = get(addr, "/flagz").await;
    assert_eq!(text.status, 200);
    assert!(text.body.contains("kube-proxy flagz"), "{}", text.body);
    assert!(
        text.body.ends_with("proxy-mode=nftables\nv=\n"),
        "{}",
        text.body
    );
    let json = with(
        "/flagz",
        "application/json;as=Flagz;v=v1beta1;g=config.k8s.io",
    )
    .await;
    assert_eq!(json.status, 200);
    let object = json.json();
    assert_eq!(object["kind"], "Flagz", "{object}");
    assert_eq!(object["flags"]["proxy-mode"], "nftables", "{object}");
    assert_eq!(with("/flagz", "application/yaml").await.status, 406);

    shutdown.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(2), task).await;

    // ComponentFlagz=false: no /flagz, and /statusz no longer lists it.
    let pages = kp_server::zpages::ZpageInfo {
        flagz: false,
        ..info_pages()
    };
    let (addr, shutdown, task) = serve_pages(pages).await;
    assert_eq!(get(addr, "/flagz").await.status, 404);
    let text = get(addr, "/statusz").await;
    assert!(
        text.body
            .contains("Paths: /configz /healthz /metrics /proxyMode /statusz\n"),
        "{}",
        text.body
    );
    shutdown.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(2), task).await;
}

/// The metrics server with `pages`, on a port of its own.
async fn serve_pages(
    pages: kp_server::zpages::ZpageInfo,
) -> (
    std::net::SocketAddr,
    CancellationToken,
    tokio::task::JoinHandle<Result<(), kp_server::ServerError>>,
) {
    let served = MetricsInfo {
        zpages: Some(pages),
        ..info()
    };
    let (listener, addr) = local_listener().await;
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(serve_metrics(
        listener,
        Arc::new(Registry::default()),
        served,
        shutdown.clone(),
    ));
    (addr, shutdown, task)
}

fn info_pages() -> kp_server::zpages::ZpageInfo {
    kp_server::zpages::ZpageInfo {
        component: "kube-proxy".to_owned(),
        started: std::time::SystemTime::now() - Duration::from_secs(90),
        binary_version: "kube-proxy-rs 9.9.9".to_owned(),
        emulation_version: "1.36".to_owned(),
        paths: Vec::new(),
        flags: [("proxy-mode", "nftables"), ("v", "")]
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .into(),
        statusz: true,
        flagz: true,
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

/// `GET /metrics` with `accept`, over a plain connection: the content type and raw body (the
/// protobuf exposition is not text).
async fn raw_metrics(addr: std::net::SocketAddr, accept: Option<&str>) -> (String, Vec<u8>) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let accept = accept
        .map(|a| format!("Accept: {a}\r\n"))
        .unwrap_or_default();
    let request =
        format!("GET /metrics HTTP/1.1\r\nHost: test\r\n{accept}Connection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.expect("read");
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("headers end");
    let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    let content_type = head
        .lines()
        .find_map(|l| l.strip_prefix("content-type: "))
        .unwrap_or_default()
        .to_owned();
    (content_type, raw[split + 4..].to_vec())
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// KEP-5808: text unless the scraper asks for the delimited MetricFamily protobuf; with the
/// `NativeHistograms` gate that carries the native fields beside the classic buckets, without
/// it classic buckets only.
#[tokio::test]
async fn metrics_negotiate_protobuf_with_native_histograms() {
    const PROTOBUF: &str = "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited";
    // zero_threshold = 6: 2^-128; positive_span = 12 {offset 0, length 1}; delta = 13: +1.
    const THRESHOLD: [u8; 9] = [0x31, 0, 0, 0, 0, 0, 0, 0xf0, 0x37];
    const SPAN_AT_ZERO: [u8; 8] = [0x62, 4, 0x08, 0, 0x10, 1, 0x68, 2];
    for gate in [true, false] {
        let native = kp_core::metrics::native::NativeHistograms::default();
        let mut registry = Registry::default();
        let metrics =
            kp_core::metrics::Metrics::register_with(&mut registry, gate.then_some(&native));
        metrics.sync_duration.observe(1.0);
        let (listener, addr) = local_listener().await;
        let shutdown = CancellationToken::new();
        let served = MetricsInfo { native, ..info() };
        let task = tokio::spawn(serve_metrics(
            listener,
            Arc::new(registry),
            served,
            shutdown.clone(),
        ));

        let (text_type, text) = raw_metrics(addr, None).await;
        assert_eq!(text_type, OPENMETRICS_CONTENT_TYPE, "gate {gate}");
        let text = String::from_utf8(text).expect("text");
        assert!(
            text.contains("kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"1.024\"} 1"),
            "{text}"
        );
        let (_, openmetrics) = raw_metrics(addr, Some("application/openmetrics-text")).await;
        assert_eq!(openmetrics, text.as_bytes(), "gate {gate}");

        let (proto_type, proto) = raw_metrics(addr, Some(PROTOBUF)).await;
        assert_eq!(
            proto_type,
            kp_server::protobuf::PROTOBUF_CONTENT_TYPE.to_ascii_lowercase(),
            "gate {gate}"
        );
        assert!(contains(
            &proto,
            b"kubeproxy_sync_proxy_rules_duration_seconds"
        ));
        // A classic bucket: cumulative_count 1, upper_bound 1.024.
        let mut bucket = vec![0x08, 1, 0x11];
        bucket.extend_from_slice(&1.024f64.to_le_bytes());
        assert!(contains(&proto, &bucket), "gate {gate}");
        assert_eq!(contains(&proto, &THRESHOLD), gate, "gate {gate}");
        assert_eq!(contains(&proto, &SPAN_AT_ZERO), gate, "gate {gate}");
        shutdown.cancel();
        task.await.expect("joins").expect("serves");
    }
}
