//! The metrics server: `/metrics`, `/healthz`, `/proxyMode` and `/configz`, as upstream's
//! (which listens on `127.0.0.1:10249` by default), and `/statusz` and `/flagz` when given
//! their content ([`crate::zpages`]).
//!
//! `/metrics` is the prometheus-client registry in the OpenMetrics 1.0 text format, sent with
//! the OpenMetrics content type. Prometheus (since 2.5) and the common agents (Grafana
//! Agent/Alloy, the OpenTelemetry collector, Datadog, VictoriaMetrics) pick their parser from
//! that content type, so serving the encoder's output unchanged is both accepted and exact;
//! rewriting it to the 0.0.4 text format would mean re-parsing it and dropping `# EOF`.
//! A scrape whose `Accept` header asks for the delimited MetricFamily protobuf gets that
//! instead ([`crate::protobuf`]), with native histogram buckets under `NativeHistograms`;
//! anything else gets the text (never a 406, as client_golang's handler).

use kp_core::report::ErrorChain as _;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::http::header::{CONTENT_TYPE, X_CONTENT_TYPE_OPTIONS};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use kp_core::metrics::native::NativeHistograms;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::explain::{EXPLAIN_PATH, Explainer};
use crate::zpages::{self, ZpageInfo};
use crate::{ServerError, serve_router};

/// The content type of the OpenMetrics 1.0 text format that prometheus-client encodes.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The configz key under which upstream publishes its configuration (the API group).
pub const CONFIGZ_KEY: &str = "kubeproxy.config.k8s.io";

/// Content type of the plain-text endpoints, as Go's handlers send.
const TEXT_PLAIN: &str = "text/plain; charset=utf-8";

/// What the metrics server reports besides the registry.
#[derive(Clone, Debug)]
pub struct MetricsInfo {
    /// The active proxy mode (`iptables`, `ipvs`, `nftables`), served at `/proxyMode`.
    pub proxy_mode: String,
    /// The effective configuration, served at `/configz` under [`CONFIGZ_KEY`].
    pub configz: serde_json::Value,
    /// `/statusz` and `/flagz` (their `paths` are filled in here); `None` serves neither.
    pub zpages: Option<ZpageInfo>,
    /// The histograms with native buckets (empty without the `NativeHistograms` gate).
    pub native: NativeHistograms,
}

#[derive(Clone)]
struct MetricsState {
    registry: Arc<Registry>,
    native: NativeHistograms,
    proxy_mode: Bytes,
    configz: Bytes,
}

/// Serves the metrics endpoints on `listener` until `shutdown` is cancelled.
///
/// The `/configz` document is encoded once here, since the configuration does not change
/// while the proxy runs; a document that cannot be encoded is an error before serving.
pub async fn serve_metrics(
    listener: TcpListener,
    registry: Arc<Registry>,
    info: MetricsInfo,
    shutdown: CancellationToken,
) -> Result<(), ServerError> {
    serve_metrics_with_explain(listener, registry, info, None, shutdown).await
}

/// [`serve_metrics`], plus `/debug/explain` answered by `explainer` when there is one (see
/// [`crate::explain`]); without one that path is a 404 like any unknown path.
pub async fn serve_metrics_with_explain(
    listener: TcpListener,
    registry: Arc<Registry>,
    info: MetricsInfo,
    explainer: Option<Arc<dyn Explainer>>,
    shutdown: CancellationToken,
) -> Result<(), ServerError> {
    let mut document = serde_json::Map::new();
    document.insert(CONFIGZ_KEY.to_owned(), info.configz);
    let configz = serde_json::to_vec(&document).map_err(ServerError::Configz)?;
    let state = MetricsState {
        registry,
        native: info.native,
        proxy_mode: Bytes::from(info.proxy_mode),
        configz: Bytes::from(configz),
    };
    let router = Router::new()
        .route("/metrics", any(metrics))
        .route("/healthz", any(healthz))
        .route("/proxyMode", any(proxy_mode))
        .route("/configz", any(configz_handler))
        .with_state(state);
    let mut paths = vec!["/configz", "/healthz", "/metrics", "/proxyMode"];
    if explainer.is_some() {
        paths.push(EXPLAIN_PATH);
    }
    let router = match info.zpages {
        Some(mut pages) => {
            for (on, path) in [(pages.flagz, "/flagz"), (pages.statusz, "/statusz")] {
                if on {
                    paths.push(path);
                }
            }
            paths.sort_unstable();
            pages.paths = paths.iter().map(|p| (*p).to_owned()).collect();
            let mut pages_router = Router::new();
            if pages.statusz {
                pages_router = pages_router.route("/statusz", get(statusz));
            }
            if pages.flagz {
                pages_router = pages_router.route("/flagz", get(flagz));
            }
            router.merge(pages_router.with_state(Arc::new(pages)))
        }
        None => router,
    };
    let router = match explainer {
        Some(explainer) => router.merge(
            Router::new()
                .route(EXPLAIN_PATH, get(crate::explain::handler))
                .with_state(explainer),
        ),
        None => router,
    };
    serve_router("metrics", listener, router, shutdown).await
}

async fn metrics(State(state): State<MetricsState>, headers: HeaderMap) -> Response {
    let mut text = String::new();
    let protobuf = headers
        .get_all(axum::http::header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(crate::protobuf::accepts_protobuf);
    match prometheus_client::encoding::text::encode(&mut text, &state.registry) {
        Ok(()) if protobuf => match crate::protobuf::encode(&text, &state.native) {
            Ok(bytes) => (
                [(
                    CONTENT_TYPE,
                    HeaderValue::from_static(crate::protobuf::PROTOBUF_CONTENT_TYPE),
                )],
                bytes,
            )
                .into_response(),
            Err(error) => {
                tracing::error!(error = %error.chain(), "cannot encode metrics as protobuf");
                StatusCode::INTERNAL_SERVER_ERROR.into_response()
            }
        },
        Ok(()) => (
            [(
                CONTENT_TYPE,
                HeaderValue::from_static(OPENMETRICS_CONTENT_TYPE),
            )],
            text,
        )
            .into_response(),
        Err(error) => {
            tracing::error!(error = %error.chain(), "cannot encode metrics");
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }
    }
}

async fn statusz(State(pages): State<Arc<ZpageInfo>>, headers: HeaderMap) -> Response {
    let now = std::time::SystemTime::now();
    zpages::respond(
        &headers,
        "Statusz",
        || pages.statusz_text(now),
        |version| pages.statusz_object(version, now),
    )
}

async fn flagz(State(pages): State<Arc<ZpageInfo>>, headers: HeaderMap) -> Response {
    zpages::respond(
        &headers,
        "Flagz",
        || pages.flagz_text(),
        |version| pages.flagz_object(version),
    )
}

/// Upstream installs the always-ok apiserver healthz handler here.
async fn healthz() -> Response {
    plain(Bytes::from_static(b"ok"))
}

async fn proxy_mode(State(state): State<MetricsState>) -> Response {
    plain(state.proxy_mode)
}

async fn configz_handler(State(state): State<MetricsState>) -> Response {
    (
        [
            (CONTENT_TYPE, HeaderValue::from_static("application/json")),
            (X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff")),
        ],
        state.configz,
    )
        .into_response()
}

fn plain(body: Bytes) -> Response {
    (
        [
            (CONTENT_TYPE, HeaderValue::from_static(TEXT_PLAIN)),
            (X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff")),
        ],
        body,
    )
        .into_response()
}
